"""KV-scale calibration for the fp8 KV cache (`calculate_kv_scales`, vLLM's name): one pass of the model over
a calibration text with a float32 cache, then each (layer, KV head)'s scale from the largest |K| and |V| it
wrote.

The text is the ShareGPT sample bundled for `jaxserve bench` (conversational English), in the model's own
tokenizer, cut into CALIBRATION_PROMPTS prompts of CALIBRATION_TOKENS tokens. Each prompt is one prefill into a
scratch pool of zeros, so the largest magnitude over the whole pool after the step is the largest the prompt
wrote. The scale maps that magnitude to 448 / HEADROOM: e4m3's relative precision is the same across its
normal range, so the headroom costs nothing for the values seen and keeps larger ones (a prompt unlike the
text) from saturating.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.attention import make_attention
from jaxserve.attention.fp8 import FP8_MAX
from jaxserve.batch.builder import prefill_batches
from jaxserve.model.registry import model_for
from jaxserve.model_spec import ModelSpec

HEADROOM = 2.0  # the largest |K| or |V| the text gave lands at FP8_MAX / HEADROOM
CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 8, 256
PAGE_SIZE = 16


def calibration_prompts(tokenizer_path: str, max_tokens: int) -> list[list[int]]:
    """The calibration text in the tokenizer of `tokenizer_path`: CALIBRATION_PROMPTS prompts of
    min(CALIBRATION_TOKENS, max_tokens) tokens (fewer prompts if the text runs out)."""
    from jaxserve.datasets import load_sharegpt
    from jaxserve.tokenizer import load_tokenizer

    _, conversations = load_sharegpt(None)
    tokenizer = load_tokenizer(tokenizer_path)
    length = min(CALIBRATION_TOKENS, max_tokens)
    ids: list[int] = []
    turns = (turn["value"] for conversation in conversations for turn in conversation["conversations"])
    for text in turns:  # turn by turn, until there is enough (never the whole text at once)
        if len(ids) >= CALIBRATION_PROMPTS * length:
            break
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
    ids = ids[: CALIBRATION_PROMPTS * length]
    return [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]


def calibrate_kv_scales(params: dict, spec: ModelSpec, mesh: Mesh, num_cache_kv_heads: int,
                        prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """{"k_scale", "v_scale": (L, cache KV heads) float32}: the largest |K| and |V| each (layer, KV head) wrote over
    `prompts`, times HEADROOM over FP8_MAX (1.0 for a head that wrote only zeros). `params` without KV scales."""
    backend = make_attention(spec, "xla", mesh, PAGE_SIZE, cache_dtype=jnp.float32)
    forward = model_for(spec.architecture).make_forward(spec, backend.attention, backend.write_kv, mesh)
    width, batches = prefill_batches(prompts, PAGE_SIZE)  # one prompt's pages, after the null page
    shapes = backend.cache_shapes(spec.num_layers, width + 1, PAGE_SIZE, num_cache_kv_heads, spec.head_dim)

    @jax.jit
    def largest(params, batch):
        caches = tuple(jnp.zeros(shape, jnp.float32) for shape in shapes)  # each (L, P, S, Hkv, D)
        _, _, (k_cache, v_cache) = forward(params, caches, batch)
        return jnp.max(jnp.abs(k_cache), axis=(1, 2, 4)), jnp.max(jnp.abs(v_cache), axis=(1, 2, 4))  # (L, Hkv) each

    k_max = v_max = np.zeros((spec.num_layers, num_cache_kv_heads), np.float32)
    for batch in batches:
        k, v = largest(params, batch)
        k_max, v_max = np.maximum(k_max, np.asarray(k)), np.maximum(v_max, np.asarray(v))
    return {name: np.where(amax > 0, amax * HEADROOM / FP8_MAX, 1.0).astype(np.float32)
            for name, amax in (("k_scale", k_max), ("v_scale", v_max))}
