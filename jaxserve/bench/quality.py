"""Teacher-forced quality of an engine's weights against a reference's: next-token distributions at every
position of fixed prompts, compared by top-1 agreement and KL divergence (quantization, issue 16).

`next_token_logprobs` runs a runner's model (its params, attention backend and KV layout) over each prompt
as one prefill into a scratch KV pool of its own, and takes the log-softmax of the logits at every position:
the distribution of the token after each prefix. Nothing goes through a scheduler or the runner's own pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import fp8
from jaxserve.batch.builder import BucketLadders, prefill_batches
from jaxserve.config import EngineConfig
from jaxserve.model.checkpoint import load_weights
from jaxserve.model.registry import load_model_spec, model_for
from jaxserve.runner.runner import Runner
from jaxserve.sharding import cache_kv_heads, make_mesh

PAGE_SIZE = 16


def scoring_runner(path: str, quantization: str = "none", kv_cache_dtype: str = "auto",
                   calculate_kv_scales: bool = False, attention_backend: str = "xla") -> Runner:
    """A Runner of a checkpoint's float32 weights (quantized under `quantization`, its KV cache in
    `kv_cache_dtype`, calibrated under `calculate_kv_scales`), compiled for nothing."""
    spec = load_model_spec(path)
    mesh = make_mesh(1)
    kv_heads = cache_kv_heads(spec, 1)
    config = EngineConfig(model=path, dtype="float32", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                          calculate_kv_scales=calculate_kv_scales)
    params, dtype = load_weights(config, path, spec, mesh, kv_heads)
    ladders = BucketLadders.build(max_num_batched_tokens=PAGE_SIZE, max_num_seqs=1, max_model_len=PAGE_SIZE,
                                  page_size=PAGE_SIZE, min_token_bucket=PAGE_SIZE, max_aux_extra=0)
    return Runner(spec, params, mesh, page_size=PAGE_SIZE, num_cache_kv_heads=kv_heads,
                  cache_dtype=fp8.cache_dtype(kv_cache_dtype, dtype), ladders=ladders,
                  attention_backend=attention_backend)


def source_prompts(model: str, count: int, num_tokens: int) -> list[list[int]]:
    """`count` prompts of `num_tokens` tokens: consecutive pieces of jaxserve's scheduler source (Python, which
    the bundled model was trained on), in the model's tokenizer."""
    import jaxserve.engine.scheduler
    from jaxserve.tokenizer import load_tokenizer

    with open(jaxserve.engine.scheduler.__file__) as f:
        ids = load_tokenizer(model).encode(f.read(), add_special_tokens=False)
    if len(ids) < count * num_tokens:
        raise ValueError(f"the source has {len(ids)} tokens, fewer than {count} x {num_tokens}")
    return [ids[i * num_tokens : (i + 1) * num_tokens] for i in range(count)]


def next_token_logprobs(runner: Runner, prompts: list[list[int]]) -> list[np.ndarray]:
    """For each prompt, (len, V) float32 log-probabilities of the next token after each of its prefixes, from the
    runner's model (an engine's `engine.core.runner`; it need not have compiled or allocated anything)."""
    width, batches = prefill_batches(prompts, runner.page_size)  # one prompt's pages, after the null page
    forward = runner.model_forward

    @jax.jit
    def score(params, batch):
        caches = tuple(jnp.zeros(s.shape, s.dtype) for s in runner.cache_structs(width + 1))
        _, hidden, _ = forward(params, caches, batch)  # hidden: (T, H)
        logits = model_for(runner.spec.architecture).token_logits(params, hidden, runner.spec)  # (T, V)
        return jax.nn.log_softmax(logits, axis=-1)

    return [np.asarray(score(runner.params, batch))[:len(prompt)] for prompt, batch in zip(prompts, batches)]


def compare_distributions(reference: list[np.ndarray], candidate: list[np.ndarray]) -> dict:
    """Top-1 agreement (the share of positions whose most likely next token is the same) and the mean and largest
    KL(reference || candidate) over every position of every prompt (nats)."""
    ref, cand = np.concatenate(reference).astype(np.float64), np.concatenate(candidate).astype(np.float64)  # (N, V)
    kl = np.sum(np.exp(ref) * (ref - cand), axis=-1)  # (N,)
    return {"positions": len(ref), "top1_agreement": float(np.mean(ref.argmax(-1) == cand.argmax(-1))),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}
