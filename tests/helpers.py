"""Shared helpers for engine tests: fixture checkpoints, their HF outputs, small engine configs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time

import httpx
import numpy as np

CHECKPOINTS = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoints")
ARCHITECTURES = ("llama", "llama-linear", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3-moe",
                 "qwen2-moe", "phi3", "granite", "olmo2", "gemma", "gpt-oss", "deepseek-v3",
                 "deepseek-v3-q-proj")
# One compilation cache for the whole test session, so engines with equal shapes compile once.
TEST_CACHE_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache")
# XLA's CPU backend at LLVM optimisation level 0 without its MLIR fusion emitters: a step program of the bundled
# model compiles in 0.21 s instead of 0.50 (level 0 alone) or 0.72 (the default), and runs 3x slower than at the
# default (docs/benchmarks.md, "The test suite"). conftest.py sets it for the suite's processes; tests that start
# Python processes of their own pass it on.
FAST_COMPILE_XLA_FLAG = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# A folder whose sitecustomize hides torch from a Python whose PYTHONPATH holds it, as on an install without
# jaxserve's bench extra. The processes the tests start run this way (conftest.py): transformers imports torch when
# it finds it, even to load a tokenizer, which cost each process about 3 s on a 2-core machine.
NO_TORCH = os.path.join(os.path.dirname(__file__), "fixtures", "no_torch")
# The tests' HTTP client, used as httpx.get/post/stream are: a new connection for each request (no keep-alive, so a
# test that kills a server or spreads requests over front ends sees what separate clients would), without the 40 ms
# each of those calls spends building a client and its TLS context, which the tests' plain-HTTP servers never use
# (34 s of a warm suite's CPU time). Used from many threads at once, as httpx's clients may be.
http_client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def pythonpath_without_torch(*folders: str) -> str:
    """A PYTHONPATH of `folders` behind NO_TORCH, for a process a test starts that does not use torch."""
    return os.pathsep.join([NO_TORCH, *folders])


def markdown_blocks(path: str, language: str) -> list[tuple[str | None, str]]:
    """(the heading above it, its text) for each fenced block of `language` in a Markdown file, in order."""
    fence = f"```{language}\n"
    blocks, heading = [], None
    text = open(path, encoding="utf-8").read()
    for part in re.split(rf"(^#+ [^\n]*$|^{fence}.*?^```$)", text, flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("#").strip()
        elif part.startswith(fence):
            blocks.append((heading, part.removeprefix(fence).removesuffix("```")))
    return blocks


def checkpoint(name: str) -> str:
    """Path of a fixture checkpoint folder."""
    return os.path.join(CHECKPOINTS, name)


def checkpoint_tensors(name: str, folder: str | None) -> dict[str, np.ndarray]:
    """Every tensor of a fixture checkpoint (its files merged), its other files (config, tokenizer) copied into
    `folder` (unless None): the start of a modified copy, which the caller saves into `folder`."""
    from safetensors import safe_open

    from jaxserve.model.loader import SafetensorsFolder  # reads float8 too (safetensors' numpy reader does not)

    source, tensors = checkpoint(name), {}
    reader = SafetensorsFolder(source)
    for file in sorted(os.listdir(source)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(source, file), framework="numpy") as f:
                tensors.update({key: reader.get(key) for key in f.keys()})
        elif folder and file != "model.safetensors.index.json" and os.path.isfile(os.path.join(source, file)):
            shutil.copy(os.path.join(source, file), folder)
    return tensors


def perturbed(tensors: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Every tensor plus noise of 0.05: new weights of the same model (for weight updates)."""
    rng = np.random.default_rng(seed)
    return {name: (t + 0.05 * rng.standard_normal(t.shape)).astype(t.dtype) for name, t in tensors.items()}


def perturbed_checkpoint(name: str, folder: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A copy of fixture `name` in `folder` with every tensor perturbed; returns the fixture's own tensors."""
    from safetensors.numpy import save_file

    tensors = checkpoint_tensors(name, folder)
    save_file(perturbed(tensors, seed), os.path.join(folder, "model.safetensors"))
    return tensors


def greedy_outputs_compiling_nothing(engines: dict) -> dict:
    """Each engine's greedy tokens (8 each) for the llama fixture prompts, asserting that none compiles after
    warm-up and that every page comes back."""
    from jaxserve import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in expected("llama")["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for key, llm in engines.items():
        assert not llm.engine.config.compilation_config.skip_precompile, \
            "only a precompiled engine can promise to compile nothing"
        before = llm.stats()["compilations_after_warmup"]
        outputs[key] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats()["compilations_after_warmup"] == before
        assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]
    return outputs


def expected(name: str) -> dict:
    """HF greedy outputs of a fixture checkpoint: prompts, outputs (20 tokens each), logits."""
    with open(os.path.join(checkpoint(name), "expected.json")) as f:
        data = json.load(f)
    data["logits"] = np.load(os.path.join(checkpoint(name), "expected_logits.npy"))  # (12, V) float32
    return data


def engine_stats(**values) -> dict:
    """An engine's stats() as the metrics collector reads it: every counter and gauge 0 unless given."""
    from jaxserve.engine.step_timing import StepTiming

    stats = dict.fromkeys(("num_requests_running", "num_requests_waiting", "num_requests_swapped", "preemptions",
                           "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                           "swapped_out_requests", "swapped_out_pages", "swapped_in_pages", "steps"), 0)
    stats.update(kv_pages_free=10, kv_pages_total=10, cpu_cache_usage_perc=0.0,
                 spec_decode={"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                              "accepted_per_position": []}, timing=StepTiming().summary())
    return {**stats, **values}


def small_engine_args(**overrides) -> dict:
    """Engine options with small bucket ladders so tests compile quickly."""
    args = dict(
        max_model_len=128,
        page_size=16,
        num_pages=64,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        min_token_bucket=64,  # one token rung: every step pads to 64 (tests that pick buckets set their own)
        min_page_bucket=4096,  # one page-table width, max_model_len's pages: a forward program per token rung
        # each bucket compiled at its first use: an engine compiles only the shapes its test reaches; a test that
        # checks nothing compiles after warm-up passes skip_precompile=False (and background_compile=True to build
        # ready early)
        skip_precompile=True,
        background_compile=False,
        compilation_cache_dir=TEST_CACHE_DIR,
        show_progress=False,
        enable_structured_outputs=False,  # the tests that constrain outputs turn it on (fewer sampler executables)
    )
    args.update(overrides)
    return args


def check_greedy_tokens_are_hfs(name: str, **engine_options) -> None:
    """An engine of the fixture checkpoint `name` built with `engine_options` gives Hugging Face's greedy tokens (the
    first 8 of its 20) to the fixture's prompts of 8 to 16 tokens, and every page comes back."""
    from jaxserve import LLM, SamplingParams

    want = expected(name)
    prompts = [{"prompt_token_ids": ids} for ids in want["prompts"][3:7]]  # 8 to 16 tokens
    llm = LLM(checkpoint(name), **small_engine_args(**engine_options))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == [output[:8] for output in want["outputs"][3:7]]
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def renamed_model(parent, markers: dict[int, str], special: bool, source: str | None = None) -> str:
    """A copy of the model folder `source` (default: the bundled model) under `parent` whose tokenizer calls each
    token id of `markers` by its marker, an added token (special or not)."""
    from jaxserve.engine.llm_engine import default_model_path

    folder = parent / "model"
    shutil.copytree(source or default_model_path(), folder)
    path = os.path.join(folder, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    names = {token_id: name for name, token_id in vocab.items()}
    for token_id, marker in markers.items():
        old = names[token_id]
        del vocab[old]
        vocab[marker] = token_id
        # merges that make or use the renamed token go with it
        spec["model"]["merges"] = [m for m in spec["model"]["merges"] if old not in m and "".join(m) != old]
        spec["added_tokens"].append({"id": token_id, "content": marker, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": special})
    with open(path, "w") as f:
        json.dump(spec, f)
    return str(folder)


@contextlib.contextmanager
def running_server(app):
    """Serve an ASGI app with a real uvicorn server on a free localhost port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


# ---- speculative decoding: a speculative engine against the plain one (tests/test_spec_*.py) ---------------------


def spec_generate(llm, prompts: list[list[int]], params) -> tuple[list, dict]:
    """(each request's samples' token ids, the increase of the spec_decode counters); checks that nothing compiled
    during the run and that every page of the KV pool (and of the draft model's, when there is one) is back."""
    assert not llm.engine.config.compilation_config.skip_precompile, \
        "only a precompiled engine can promise to compile nothing"
    before = llm.stats()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = llm.stats()
    assert after["compilations_after_warmup"] == before["compilations_after_warmup"], "compiled after warm-up"
    assert after["lazy_bucket_compilations"] == 0
    assert after["kv_pages_free"] == after["kv_pages_total"]
    assert after["draft_kv_pages_free"] == after["draft_kv_pages_total"]
    moved = {key: after["spec_decode"][key] - before["spec_decode"][key]
             for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return [[tuple(c.token_ids) for c in o.outputs] for o in outputs], moved


def check_same_tokens_under_preemption(plain, spec, prompts: list[list[int]], params) -> dict:
    """Run both engines on `prompts`: the speculative one must preempt and give the plain one's tokens; returns
    its spec_decode counters' increase."""
    before = spec.stats()["preemptions"]
    want, _ = spec_generate(plain, prompts, params)
    got, moved = spec_generate(spec, prompts, params)
    assert spec.stats()["preemptions"] > before, "the pool was not small enough to preempt"
    assert got == want
    return moved


def check_seeded_runs_give_plain_tokens(plain, spec, prompts: list[list[int]], params) -> dict:
    """Two runs of the speculative engine must each give the plain engine's seeded tokens (the second run's prompts
    hit the prefix cache, so other steps verify); returns the first run's spec_decode counters' increase."""
    want, _ = spec_generate(plain, prompts, params)
    first, moved = spec_generate(spec, prompts, params)
    second, _ = spec_generate(spec, prompts, params)
    assert first == want and second == want
    return moved


# ---- a chat reply as the chat route streams it (tests/test_responses_api.py, tests/test_messages_api.py) ---------

CHAT_REPLY = [("reasoning", "let me think about it"), ("content", "The answer: "), ("call", '{"answer": 42}'),
              ("call", '{"answer": 7}')]


def chat_reply_deltas(cuts: list[int]) -> list[dict]:
    """CHAT_REPLY as chat deltas, each part cut at the character positions `cuts`; tool calls as the chat route
    streams them (the first delta of a call names it, the next ones add arguments)."""
    deltas = []
    for index, (kind, text) in enumerate(CHAT_REPLY):
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if a < b] if cuts else [text]
        for n, piece in enumerate(pieces):
            if kind != "call":
                deltas.append({kind: piece})
            elif n == 0:
                deltas.append({"tool_calls": [{"index": index - 2, "id": f"call_{index}", "type": "function",
                                               "function": {"name": "answer", "arguments": piece}}]})
            else:
                deltas.append({"tool_calls": [{"index": index - 2, "function": {"arguments": piece}}]})
    return deltas


def whole_chat_reply() -> dict:
    """CHAT_REPLY as one chat delta."""
    deltas = chat_reply_deltas([])
    return {"reasoning": CHAT_REPLY[0][1], "content": CHAT_REPLY[1][1],
            "tool_calls": deltas[2]["tool_calls"] + deltas[3]["tool_calls"]}


# ---- a checkpoint served against Hugging Face's reference (tests/test_*_checkpoint.py) ---------------------------


def assert_serves_hf_outputs(llm, name: str) -> None:
    """`llm` serving fixture checkpoint `name` gives HF's 20 greedy tokens for every prompt and HF's log-probabilities
    of its first token's top 5 (1e-4), and every page comes back."""
    from jaxserve import SamplingParams

    want = expected(name)
    prompts = [{"prompt_token_ids": p} for p in want["prompts"]]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want["outputs"]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for result, logits in zip(llm.generate(prompts, params, use_tqdm=False), want["logits"]):
        hf_logprobs = logits - np.logaddexp.reduce(logits.astype(np.float64))  # (V,)
        for token_id, logprob in result.outputs[0].logprobs[0].items():
            assert abs(logprob.logprob - hf_logprobs[token_id]) <= 1e-4, (token_id, logprob, hf_logprobs[token_id])
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def tiny_llama_config(**fields) -> dict:
    """A tiny LlamaForCausalLM config.json (as a dict, with `fields` added), for checks made while parsing it."""
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32, **fields}


# ---- attention with sinks, the kernels' tests' float64 reference (tests/test_*attention*.py) --------------------


def attention_with_sinks(q, keys, values, sinks, *, sm_scale, soft_cap):
    """Softmax over [scores..., sink] per query head with the sink's column dropped, in float64.

    q: (Hq, D); keys, values: (K, Hkv, D), the keys the query sees; sinks: (Hq,). Returns (Hq, D).
    """
    group = q.shape[0] // keys.shape[1]
    keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)  # (K, Hq, D): head h, kv h // G
    scores = np.einsum("hd,khd->hk", q, keys) * sm_scale  # (Hq, K)
    if soft_cap is not None:
        scores = soft_cap * np.tanh(scores / soft_cap)
    logits = np.concatenate([scores, sinks[:, None]], axis=1)  # (Hq, K + 1)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return np.einsum("hk,khd->hd", probs[:, :-1], values)  # (Hq, D)
