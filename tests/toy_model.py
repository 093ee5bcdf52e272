"""A complete architecture added from outside the engine (docs/models.md): `ToyForCausalLM`, a small decoder with
a fused qkv projection, RoPE, tied embeddings and a squared-ReLU MLP, as a Flax NNX module.

Importing this module registers it; the engine then serves any folder whose config.json names it, with every
engine feature (continuous batching, chunked prefill, prefix caching, preemption, the server), and no engine code
changes. `write_checkpoint` makes a random one, and `reference_greedy` decodes it with plain numpy.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from jaxserve.attention.base import LayerAttention
from jaxserve.model.layers import StepContext, apply_rope, rms_norm, rope_cos_sin, scan_layers
from jaxserve.model.registry import Model, Weight, register
from jaxserve.model_spec import ModelSpec, RopeSpec

ARCHITECTURE = "ToyForCausalLM"


def toy_spec(arch: str, config: dict, generation_config: dict) -> ModelSpec:
    """The spec of a toy config.json (multi-head attention: as many KV heads as query heads)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    return ModelSpec(architecture=arch, vocab_size=config["vocab_size"], hidden_size=hidden,
                     num_layers=config["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
                     head_dim=hidden // heads, intermediate_size=config["intermediate_size"], rms_norm_eps=1e-6,
                     rope=RopeSpec(theta=config["rope_theta"], head_dim=hidden // heads),
                     max_position_embeddings=config["max_position_embeddings"], tie_word_embeddings=True,
                     eos_token_ids=(config["eos_token_id"],))


def toy_weights(spec: ModelSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """Every params leaf with its checkpoint tensor ("{i}": the layer), shape and sharding (all replicated:
    the fused qkv columns would need a head-aware split for tensor parallelism)."""
    layers, hidden, inner = spec.num_layers, spec.hidden_size, spec.intermediate_size

    def block(name: str, shape: tuple[int, ...], transpose: bool = False) -> Weight:
        return Weight(f"blocks.{{i}}.{name}", (layers, *shape), P(*[None] * (1 + len(shape))), transpose=transpose)

    return {
        "embed": Weight("embed.weight", (spec.vocab_size, hidden), P(None, None)),
        "final_norm": Weight("norm.weight", (hidden,), P(None), ones=True),
        "layers": {
            "attn_norm": block("attn_norm.weight", (hidden,)),
            "qkv": block("qkv.weight", (hidden, 3 * hidden), transpose=True),
            "out": block("out.weight", (hidden, hidden), transpose=True),
            "mlp_norm": block("mlp_norm.weight", (hidden,)),
            "up": block("up.weight", (hidden, inner), transpose=True),
            "down": block("down.weight", (inner, hidden), transpose=True),
        },
    }


class ToyLayer(nnx.Module):
    """x + attention(norm(x)), then x + down(relu(up(norm(x)))^2)."""

    def __init__(self, params: dict, spec: ModelSpec):
        self.spec = spec
        self.attn_norm, self.mlp_norm = nnx.Param(params["attn_norm"]), nnx.Param(params["mlp_norm"])
        self.qkv, self.out = nnx.Param(params["qkv"]), nnx.Param(params["out"])
        self.up, self.down = nnx.Param(params["up"]), nnx.Param(params["down"])

    def __call__(self, x, caches, layer, rope, step: StepContext):
        # x: (T, H); rope: cos, sin (T, D // 2) each
        spec = self.spec
        h = rms_norm(x, self.attn_norm[...], spec.rms_norm_eps)
        q, k, v = jnp.split((h @ self.qkv[...]).reshape(x.shape[0], 3 * spec.num_heads, spec.head_dim), 3, axis=1)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # (T, heads, D) each
        attn, caches = step.attend(q, k, v, caches, layer, (LayerAttention(sm_scale=spec.head_dim**-0.5),))
        x = x + attn.reshape(x.shape[0], -1) @ self.out[...]
        h = rms_norm(x, self.mlp_norm[...], spec.rms_norm_eps)
        return x + jnp.square(jax.nn.relu(h @ self.up[...])) @ self.down[...], caches


class ToyForCausalLM(nnx.Module):
    """Embedding -> scanned `ToyLayer`s -> final norm -> the tied LM head."""

    def __init__(self, params: dict, spec: ModelSpec):
        self.spec = spec
        self.embed, self.final_norm = nnx.Param(params["embed"]), nnx.Param(params["final_norm"])
        self.layers = ToyLayer(params["layers"], spec)

    def __call__(self, caches, step: StepContext):
        """(logits (R, V) float32 of each row's last token, hidden (T, H), caches)."""
        rope = rope_cos_sin(step.batch.positions, self.spec.rope.inv_freq())
        x = self.embed[...][step.batch.input_ids]  # (T, H)
        x, caches = scan_layers(self.layers, (x, caches), lambda layer, carry, i: layer(*carry, i, rope, step))
        return self.logits(x[step.batch.logits_indices]), x, caches

    def logits(self, hidden):
        """Final norm and the tied LM head: (N, H) -> (N, V) float32."""
        normed = rms_norm(hidden, self.final_norm[...], self.spec.rms_norm_eps)
        return jnp.dot(normed, self.embed[...].T, preferred_element_type=jnp.float32)


register((ARCHITECTURE,), Model(spec_from_config=toy_spec, weights=toy_weights, module=ToyForCausalLM))

CONFIG = {"architectures": [ARCHITECTURE], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 128, "rope_theta": 10000.0, "max_position_embeddings": 512,
          "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}


def write_checkpoint(folder: str, tokenizer_folder: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A random toy checkpoint (config, safetensors, the tokenizer of `tokenizer_folder`); returns its tensors."""
    rng = np.random.default_rng(seed)
    hidden, inner, vocab = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    tensors = {"embed.weight": rng.normal(0, 0.5, (vocab, hidden)), "norm.weight": 1 + rng.normal(0, 0.1, hidden)}
    for i in range(CONFIG["num_hidden_layers"]):
        for name, shape in (("attn_norm", (hidden,)), ("mlp_norm", (hidden,))):
            tensors[f"blocks.{i}.{name}.weight"] = 1 + rng.normal(0, 0.1, shape)
        for name, shape in (("qkv", (3 * hidden, hidden)), ("out", (hidden, hidden)), ("up", (inner, hidden)),
                            ("down", (hidden, inner))):
            tensors[f"blocks.{i}.{name}.weight"] = rng.normal(0, 0.2, shape)
    tensors = {name: value.astype(np.float32) for name, value in tensors.items()}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_folder, name), folder)
    return tensors


def reference_greedy(tensors: dict[str, np.ndarray], prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with plain numpy (float64), the whole sequence recomputed every token."""
    heads, hidden = CONFIG["num_attention_heads"], CONFIG["hidden_size"]
    head_dim = hidden // heads
    inv_freq = 1.0 / CONFIG["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w

    def rope(x, positions):  # x: (T, heads, D)
        angles = positions[:, None] * inv_freq[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    ids = list(prompt)
    for _ in range(num_tokens):
        t = len(ids)
        x = tensors["embed.weight"][ids].astype(np.float64)  # (T, H)
        positions = np.arange(t, dtype=np.float64)
        for i in range(CONFIG["num_hidden_layers"]):
            w = {name: tensors[f"blocks.{i}.{name}.weight"].astype(np.float64)
                 for name in ("attn_norm", "qkv", "out", "mlp_norm", "up", "down")}
            q, k, v = np.split((norm(x, w["attn_norm"]) @ w["qkv"].T).reshape(t, 3 * heads, head_dim), 3, axis=1)
            q, k = rope(q, positions), rope(k, positions)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(head_dim)
            scores = np.where(np.tril(np.ones((t, t), bool))[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(t, hidden) @ w["out"].T
            h = norm(x, w["mlp_norm"])
            x = x + np.square(np.maximum(h @ w["up"].T, 0)) @ w["down"].T
        logits = norm(x[-1], tensors["norm.weight"]) @ tensors["embed.weight"].T
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):]
