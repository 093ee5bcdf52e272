#!/usr/bin/env python
"""Train jaxserve's small default model on the Python standard library's source.

The model is a tiny Llama (grouped-query attention, RoPE, RMSNorm, SwiGLU,
tied embeddings) written in Hugging Face format, so jaxserve loads it through
the same path as real checkpoints. Everything it needs is on every machine
with Python: the training text is the standard library's own ``*.py`` files.

Steps:

1. Corpus: a deterministic subset of the stdlib's ``*.py`` files (no tests,
   no site-packages, no generated tables); a few files are held out for an
   eval loss.
2. Tokenizer: byte-level BPE trained with ``tokenizers``, wrapped in a
   ``transformers.PreTrainedTokenizerFast`` with a chat template.
3. Model: the forward pass in plain JAX, trained with optax AdamW (linear
   warmup, cosine decay, gradient clipping) on random token windows.
4. Export: ``model.safetensors`` with Hugging Face Llama names and layout,
   ``config.json``, ``generation_config.json``, tokenizer files and
   ``training_log.json``.
5. Check (only when torch is importable): the folder loaded with
   ``AutoModelForCausalLM`` gives the same logits as the JAX forward, and a few
   greedy samples are printed.

Run from the repository root (about 20 minutes on an idle 2-core CPU)::

    python scripts/train_default_model.py --out jaxserve/assets/tiny-stdlib-llama

``--time-budget-minutes`` bounds the training time: the learning-rate
schedule follows whichever is further along, the step count or the elapsed
share of the budget, and training stops when the budget is spent, so a slow
machine still ends with a fully decayed learning rate and a saved model. On a
machine fast enough to finish the steps within the budget the run depends only
on the seed (and the Python / library versions, which fix the corpus and the
float rounding).
"""

from __future__ import annotations

import os

# Never touch the network: everything is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import hashlib
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
import transformers
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

jax.config.update("jax_default_matmul_precision", "highest")

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
# Tools (OpenAI's shape) go in a system turn first, and an assistant turn's tool calls are written as Hermes
# `<tool_call>` blocks (`jaxserve serve --tool-call-parser hermes` reads them); without tools, the format the model
# was trained on.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou may call these functions. To call one, reply with <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call>.\n{% for tool in tools %}{{ tool['function'] | tojson }}\n{% endfor %}</s>\n"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.get('tool_calls') %}{% for call in m['tool_calls'] %}<tool_call>{{ call['function'] | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Folders of the standard library that are not ordinary hand-written code:
# tests (some hold Python 2 or deliberately broken files), GUI demos, codec
# tables, the pydoc topic dump, and installed third-party packages.
EXCLUDED_DIRS = {
    "__pycache__",
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "turtledemo",
    "encodings",
    "pydoc_data",
    "__phello__",
}
MAX_FILE_BYTES = 300_000  # skip the odd huge (generated) file
EVAL_FRACTION = 0.05  # share of the corpus bytes held out for the eval loss

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
CHECK_PROMPTS = SAMPLE_PROMPTS + ["for i in range(10):\n    print(", "\"\"\"Docstring.\"\"\"\n\nimport sys"]
CHECK_ATOL = 1e-4


@dataclass(frozen=True)
class ModelShape:
    """The Llama hyper-parameters of the default model."""

    vocab_size: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# --------------------------------------------------------------------------
# 1. Corpus
# --------------------------------------------------------------------------


@dataclass
class Corpus:
    """The training and held-out files' texts and where they came from."""

    stdlib: str
    train_files: list[str]
    eval_files: list[str]
    train_texts: list[str]
    eval_texts: list[str]

    def stats(self) -> dict:
        return {
            "stdlib": self.stdlib,
            "train_files": len(self.train_files),
            "eval_files": len(self.eval_files),
            "train_bytes": sum(len(t.encode()) for t in self.train_texts),
            "eval_bytes": sum(len(t.encode()) for t in self.eval_texts),
        }


def stdlib_python_files(root: Path) -> list[Path]:
    """Every ``*.py`` under ``root`` outside ``EXCLUDED_DIRS``, sorted by relative path."""
    files = []
    for path in root.rglob("*.py"):
        rel_dirs = path.relative_to(root).parts[:-1]
        if any(d in EXCLUDED_DIRS or d.startswith("config-") for d in rel_dirs):
            continue
        if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def path_rank(rel_path: str) -> str:
    """A stable pseudo-random rank of a file (so the subset is spread over the stdlib)."""
    return hashlib.sha256(rel_path.encode()).hexdigest()


def build_corpus(max_bytes: int) -> Corpus:
    """Pick stdlib files in ``path_rank`` order up to ``max_bytes`` and split off the eval files.

    The first files in rank order, up to ``EVAL_FRACTION`` of ``max_bytes``, are
    held out; the next ones, up to ``max_bytes`` in all, are for training.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    ranked = sorted(stdlib_python_files(root), key=lambda p: path_rank(p.relative_to(root).as_posix()))
    eval_budget = int(max_bytes * EVAL_FRACTION)
    corpus = Corpus(str(root), [], [], [], [])
    used = 0
    for path in ranked:
        text = path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")
        size = len(text.encode())
        if used + size > max_bytes:
            continue  # a smaller file further on may still fit
        rel = path.relative_to(root).as_posix()
        if used < eval_budget:
            corpus.eval_files.append(rel)
            corpus.eval_texts.append(text)
        else:
            corpus.train_files.append(rel)
            corpus.train_texts.append(text)
        used += size
    return corpus


# --------------------------------------------------------------------------
# 2. Tokenizer
# --------------------------------------------------------------------------


def build_tokenizer(texts: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with exactly ``vocab_size`` entries on ``texts``.

    Encoding adds ``<s>`` in front (as Llama tokenizers do); decoding is the
    byte-level inverse, so every string round-trips.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_length,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> np.ndarray:
    """All ``texts`` as one id stream, each file as ``<s> ... </s>``.

    Returns int32 ``(num_tokens,)``.
    """
    encodings = tokenizer.backend_tokenizer.encode_batch(texts)  # each starts with <s>
    return np.concatenate([np.asarray(e.ids + [EOS_ID], dtype=np.int32) for e in encodings])


# --------------------------------------------------------------------------
# 3. Model (plain JAX)
# --------------------------------------------------------------------------
#
# Params pytree (D = hidden, H = heads, K = KV heads, d = head_dim,
# F = intermediate, V = vocab); Linear weights are stored (in, out):
#
#   embed        (V, D)      also the output projection (tied)
#   layers[i]    input_norm (D,), wq (D, H*d), wk (D, K*d), wv (D, K*d),
#                wo (H*d, D), post_norm (D,), w_gate (D, F), w_up (D, F),
#                w_down (F, D)
#   final_norm   (D,)


def init_params(shape: ModelShape, key: jax.Array) -> dict:
    """Random init: N(0, 0.02) matrices, residual outputs scaled by 1/sqrt(2 * layers), unit norms."""
    D, F, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    H, K = shape.num_attention_heads, shape.num_key_value_heads
    std, out_std = 0.02, 0.02 / math.sqrt(2 * shape.num_hidden_layers)
    keys = iter(jax.random.split(key, 1 + 7 * shape.num_hidden_layers))

    def normal(shape_, s):
        return s * jax.random.normal(next(keys), shape_, jnp.float32)

    layers = []
    for _ in range(shape.num_hidden_layers):
        layers.append(
            {
                "input_norm": jnp.ones((D,), jnp.float32),
                "wq": normal((D, H * d), std),
                "wk": normal((D, K * d), std),
                "wv": normal((D, K * d), std),
                "wo": normal((H * d, D), out_std),
                "post_norm": jnp.ones((D,), jnp.float32),
                "w_gate": normal((D, F), std),
                "w_up": normal((D, F), std),
                "w_down": normal((F, D), out_std),
            }
        )
    return {
        "embed": normal((shape.vocab_size, D), std),
        "layers": layers,
        "final_norm": jnp.ones((D,), jnp.float32),
    }


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x (..., D) -> (..., D), as HF ``LlamaRMSNorm``."""
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return weight * (x * jax.lax.rsqrt(variance + eps))


def rope_cos_sin(seq_len: int, shape: ModelShape) -> tuple[jax.Array, jax.Array]:
    """cos, sin (T, d) for positions 0..T-1, as HF's default rotary embedding."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # (d/2,)
    freqs = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (T, d/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # (T, d)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jax.Array) -> jax.Array:
    """(..., d) -> (..., d): [x1, x2] -> [-x2, x1], HF Llama's rotation."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def attention(layer: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, shape: ModelShape) -> jax.Array:
    """Causal grouped-query self-attention over full sequences: x (B, T, D) -> (B, T, D)."""
    B, T, _ = x.shape
    H, K, d = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    q = (x @ layer["wq"]).reshape(B, T, H, d)
    k = (x @ layer["wk"]).reshape(B, T, K, d)
    v = (x @ layer["wv"]).reshape(B, T, K, d)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, d)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    q = q.reshape(B, T, K, H // K, d)  # query heads grouped by the KV head they share
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(d)  # (B, K, G, T, T)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(B, T, H * d)
    return out @ layer["wo"]


def mlp(layer: dict, x: jax.Array) -> jax.Array:
    """SwiGLU: x (B, T, D) -> (B, T, D)."""
    return (jax.nn.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]


def forward(params: dict, tokens: jax.Array, shape: ModelShape) -> jax.Array:
    """Logits (B, T, V) float32 for tokens (B, T) int32 at positions 0..T-1."""
    cos, sin = rope_cos_sin(tokens.shape[1], shape)
    x = params["embed"][tokens]  # (B, T, D)
    for layer in params["layers"]:
        x = x + attention(layer, rms_norm(x, layer["input_norm"], shape.rms_norm_eps), cos, sin, shape)
        x = x + mlp(layer, rms_norm(x, layer["post_norm"], shape.rms_norm_eps))
    x = rms_norm(x, params["final_norm"], shape.rms_norm_eps)
    return x @ params["embed"].T  # tied output projection


def loss_fn(params: dict, batch: jax.Array, shape: ModelShape) -> jax.Array:
    """Mean next-token cross-entropy of batch (B, T+1) int32."""
    logits = forward(params, batch[:, :-1], shape)  # (B, T, V)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def make_optimizer(weight_decay: float, clip_norm: float) -> optax.GradientTransformation:
    """AdamW *without* the learning rate (the step multiplies it in), clipped first.

    Weight decay applies to the matrices only (not to the norm weights).
    """
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
        optax.add_decayed_weights(weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p)),
    )


def learning_rate(
    progress: float, step: int, peak: float, warmup_steps: int, total_steps: int, final_ratio: float = 0.1
) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``final_ratio * peak``.

    ``progress`` (0..1) is how far the run is; the cosine runs from the end of
    the warmup (progress ``warmup_steps / total_steps``) to progress 1.
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    start = warmup_steps / total_steps
    frac = min(max((progress - start) / (1.0 - start), 0.0), 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * frac))
    return peak * (final_ratio + (1.0 - final_ratio) * cosine)


def make_train_step(shape: ModelShape, optimizer: optax.GradientTransformation):
    """Jitted (params, opt_state, batch (B, T+1), lr) -> (params, opt_state, loss)."""

    def step(params, opt_state, batch, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, shape)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def random_windows(tokens: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int) -> np.ndarray:
    """``batch_size`` random windows of ``seq_len + 1`` tokens: (B, T+1) int32."""
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    return tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Up to ``max_windows`` evenly spaced non-overlapping windows: (N, T+1) int32."""
    count = min(max_windows, (len(tokens) - 1) // (seq_len + 1))
    starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
    return tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def evaluate(params: dict, windows: np.ndarray, shape: ModelShape, eval_fn, batch_size: int) -> float:
    """Mean loss over ``windows`` (N, T+1), evaluated ``batch_size`` windows at a time."""
    total = 0.0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        total += float(eval_fn(params, jnp.asarray(chunk))) * len(chunk)
    return total / len(windows)


def train(params, shape, train_tokens, eval_tokens, args) -> tuple[dict, dict]:
    """Train ``params``; return (trained params, log dict with the loss curve)."""
    optimizer = make_optimizer(args.weight_decay, args.clip_norm)
    opt_state = optimizer.init(params)
    train_step = make_train_step(shape, optimizer)
    eval_fn = jax.jit(lambda p, b: loss_fn(p, b, shape))
    windows = eval_windows(eval_tokens, args.seq_len, args.eval_windows)
    rng = np.random.default_rng(args.seed)
    budget_s = args.time_budget_minutes * 60.0
    warmup = min(args.warmup_steps, max(1, args.steps // 10))

    curve, evals, recent = [], [], []
    start = time.perf_counter()
    last_t, last_step = start, 0
    step = 0
    time_limited = False
    while step < args.steps:
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            time_limited = True
            print(f"time budget of {args.time_budget_minutes:g} min spent after {step} steps; stopping")
            break
        progress = max(step / args.steps, elapsed / budget_s)
        lr = learning_rate(progress, step, args.lr, warmup, args.steps)
        batch = random_windows(train_tokens, rng, args.batch_size, args.seq_len)
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(batch), jnp.float32(lr))
        step += 1
        recent.append(loss)
        if step % args.log_every == 0 or step == args.steps:
            mean_loss = float(np.mean([float(x) for x in recent]))
            now = time.perf_counter()
            tok_s = (step - last_step) * args.batch_size * args.seq_len / (now - last_t)
            print(f"step {step:5d}  loss {mean_loss:.4f}  lr {lr:.2e}  {tok_s:7.0f} tok/s  {now - start:6.0f}s")
            curve.append(
                {"step": step, "train_loss": round(mean_loss, 4), "lr": lr, "elapsed_s": round(now - start, 1)}
            )
            recent, last_t, last_step = [], now, step
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            ev = evaluate(params, windows, shape, eval_fn, args.batch_size)
            print(f"step {step:5d}  eval loss {ev:.4f}")
            evals.append({"step": step, "eval_loss": round(ev, 4)})
    train_s = time.perf_counter() - start

    # Both final losses are measured the same way: fixed windows, final params.
    final_eval = evaluate(params, windows, shape, eval_fn, args.batch_size)
    train_windows = eval_windows(train_tokens, args.seq_len, args.eval_windows)
    final_train = evaluate(params, train_windows, shape, eval_fn, args.batch_size)
    print(f"final: train loss {final_train:.4f}  eval loss {final_eval:.4f}  ({step} steps, {train_s:.0f}s)")
    evals.append({"step": step, "eval_loss": round(final_eval, 4)})
    log = {
        "steps_requested": args.steps,
        "steps_done": step,
        "time_limited": time_limited,
        "train_seconds": round(train_s, 1),
        "tokens_seen": step * args.batch_size * args.seq_len,
        "final_train_loss": round(final_train, 4),
        "final_eval_loss": round(final_eval, 4),
        "eval_windows": len(windows),
        "loss_curve": curve,
        "eval_curve": evals,
    }
    return params, log


# --------------------------------------------------------------------------
# 4. Export in Hugging Face format
# --------------------------------------------------------------------------


def hf_config(shape: ModelShape) -> LlamaConfig:
    """The transformers ``LlamaConfig`` of ``shape``."""
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def to_hf_state_dict(params: dict) -> dict[str, np.ndarray]:
    """HF Llama tensor names -> float32 arrays; Linear weights transposed to (out, in)."""

    def linear(w):
        return np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)

    def vector(w):
        return np.asarray(w, dtype=np.float32)

    state = {"model.embed_tokens.weight": vector(params["embed"])}
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = vector(layer["input_norm"])
        state[p + "self_attn.q_proj.weight"] = linear(layer["wq"])
        state[p + "self_attn.k_proj.weight"] = linear(layer["wk"])
        state[p + "self_attn.v_proj.weight"] = linear(layer["wv"])
        state[p + "self_attn.o_proj.weight"] = linear(layer["wo"])
        state[p + "post_attention_layernorm.weight"] = vector(layer["post_norm"])
        state[p + "mlp.gate_proj.weight"] = linear(layer["w_gate"])
        state[p + "mlp.up_proj.weight"] = linear(layer["w_up"])
        state[p + "mlp.down_proj.weight"] = linear(layer["w_down"])
    state["model.norm.weight"] = vector(params["final_norm"])
    return state  # no lm_head.weight: the embeddings are tied


def save_folder(out: Path, params: dict, shape: ModelShape, tokenizer, log: dict) -> None:
    """Write the complete Hugging Face model folder ``out`` (replacing an old one)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(to_hf_state_dict(params), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
    config = hf_config(shape)
    config.save_pretrained(out)
    assert (out / "config.json").read_text() == config.to_json_string(), "config.json differs from LlamaConfig"
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def folder_size(path: Path) -> int:
    """Total bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------
# 5. Check against transformers (torch)
# --------------------------------------------------------------------------


def check_with_transformers(out: Path, params: dict, shape: ModelShape) -> dict | None:
    """Compare HF logits with the JAX forward and print greedy samples; None without torch."""
    try:
        import torch
    except ImportError:
        print("torch not importable: skipping the Hugging Face export check")
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    max_diff = 0.0
    for prompt in CHECK_PROMPTS:
        ids = tok(prompt)["input_ids"]  # starts with <s>
        with torch.no_grad():
            hf_logits = model(input_ids=torch.tensor([ids])).logits[0].numpy()  # (T, V)
        jax_logits = np.asarray(forward(params, jnp.asarray([ids], dtype=jnp.int32), shape))[0]
        max_diff = max(max_diff, float(np.abs(hf_logits - jax_logits).max()))
    ok = max_diff <= CHECK_ATOL
    verdict = "OK" if ok else "FAILED"
    print(f"export check: max |HF - JAX| logit difference {max_diff:.2e} ({verdict}, atol {CHECK_ATOL})")

    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=48, do_sample=False)
        text = tok.decode(gen[0], skip_special_tokens=True)
        samples[prompt] = text
        print(f"--- greedy sample for {prompt!r}:\n{text.rstrip()}\n")
    if not ok:
        raise SystemExit(f"export check failed: {max_diff:.2e} > {CHECK_ATOL}")
    return {"max_abs_logit_diff": max_diff, "torch_version": torch.__version__, "samples": samples}


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("jaxserve/assets/tiny-stdlib-llama"))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--time-budget-minutes", type=float, default=25.0,
                   help="stop training (and still save) once this much time is spent")
    p.add_argument("--corpus-mb", type=float, default=6.0, help="stdlib source to use, in MB")
    p.add_argument("--vocab-size", type=int, default=ModelShape.vocab_size)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500, help="0: only at the end")
    p.add_argument("--eval-windows", type=int, default=64)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    wall_start = time.perf_counter()
    shape = ModelShape(vocab_size=args.vocab_size)

    corpus = build_corpus(int(args.corpus_mb * 1e6))
    stats = corpus.stats()
    print(f"corpus: {stats['train_files']} train files ({stats['train_bytes'] / 1e6:.2f} MB), "
          f"{stats['eval_files']} eval files ({stats['eval_bytes'] / 1e6:.2f} MB) from {corpus.stdlib}")

    t0 = time.perf_counter()
    tokenizer = build_tokenizer(corpus.train_texts, shape.vocab_size, shape.max_position_embeddings)
    train_tokens = token_stream(tokenizer, corpus.train_texts)
    eval_tokens = token_stream(tokenizer, corpus.eval_texts)
    stats.update(train_tokens=len(train_tokens), eval_tokens=len(eval_tokens),
                 train_bytes_per_token=round(stats["train_bytes"] / len(train_tokens), 3))
    print(f"tokenizer: vocab {shape.vocab_size}, {len(train_tokens)} train / {len(eval_tokens)} eval tokens "
          f"({stats['train_bytes_per_token']} bytes/token, {time.perf_counter() - t0:.1f}s)")

    params = init_params(shape, jax.random.PRNGKey(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tokens_per_step = args.batch_size * args.seq_len
    print(f"model: {n_params / 1e6:.2f}M params ({shape}); {args.steps} steps x {tokens_per_step} tokens "
          f"= {args.steps * tokens_per_step / len(train_tokens):.1f} epochs")

    params, train_log = train(params, shape, train_tokens, eval_tokens, args)

    log = {
        **train_log,
        "wall_seconds": None,  # filled in below
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_shape": asdict(shape),
        "num_params": int(n_params),
        "corpus": stats,
        "corpus_files": {"train": corpus.train_files, "eval": corpus.eval_files},
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "optax": optax.__version__,
            "numpy": np.__version__,
            "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__,
        },
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
    }
    log["wall_seconds"] = round(time.perf_counter() - wall_start, 1)
    save_folder(args.out, params, shape, tokenizer, log)
    print(f"saved {args.out} ({folder_size(args.out) / 1e6:.2f} MB)")

    check = check_with_transformers(args.out, params, shape)
    if check is not None:
        log["export_check"] = check
        log["wall_seconds"] = round(time.perf_counter() - wall_start, 1)
        (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
