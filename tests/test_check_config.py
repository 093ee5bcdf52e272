"""`jaxserve check-config` lowers every shipped config for cuda and tpu on the CPU (abstract weights, no
checkpoint), picks the backend each platform would, and sizes device memory with kv/sizing.py.

The shipped configs run in one subprocess (the 70B config needs 8 devices; this process has 4) with
`--buckets largest`, to keep this file near a minute on a 2-core CPU (`--buckets all` is the docs run); the
edge selection is checked on the 8B config's ladders, and the failure reports in this process on the bundled
model."""

import glob
import itertools
import json
import os
import subprocess
import sys

import pytest

from helpers import FAST_COMPILE_XLA_FLAG, pythonpath_without_torch

from jaxserve import check_config
from jaxserve.batch.builder import BucketLadders
from jaxserve.cli import build_parser
from jaxserve.config import CONFIGS_DIR, EngineConfig
from jaxserve.kv.sizing import DEVICE_MEMORY_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(CONFIGS_DIR, "*.yaml")))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """(the command's result, its JSON by config name) for every shipped config, both platforms, the largest
    bucket of each kind; in a fresh process, which sets its own device count and XLA flags."""
    path = tmp_path_factory.mktemp("check") / "checks.json"
    # this process's 4 simulated devices are not the command's business; the fast compile flag is
    env = {**os.environ, "PYTHONPATH": pythonpath_without_torch(ROOT), "XLA_FLAGS": FAST_COMPILE_XLA_FLAG}
    command = [sys.executable, "-m", "jaxserve", "check-config", *SHIPPED, "--buckets", "largest",
               "--json", str(path)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result, {check["name"]: check for check in json.loads(path.read_text())}


def test_every_shipped_config_lowers_for_cuda_and_tpu(shipped):
    from jaxserve.attention import resolve_backend

    result, checks = shipped
    assert sorted(checks) == sorted(os.path.splitext(os.path.basename(p))[0] for p in SHIPPED)
    for name, check in checks.items():
        config = EngineConfig.from_yaml(check["config"])
        spec, _ = check_config.resolve_spec(config.model_config.model, None)
        assert [p["platform"] for p in check["platforms"]] == ["cuda", "tpu"]
        for platform in check["platforms"]:
            assert platform["error"] is None, (name, platform["error"])
            expected = resolve_backend(config.compilation_config.attention_backend, spec,
                                       config.cache_config.page_size, check_config.PLATFORMS[platform["platform"]],
                                       config.parallel_config.tensor_parallel_size)
            assert platform["backend"] == expected
            assert platform["buckets"] and all(b["error"] is None and b["seconds"] > 0 for b in platform["buckets"])
            if platform["backend"] == "pallas" and platform["platform"] == "cuda":
                assert "__gpu$xla.gpu.triton" in platform["custom_calls"]  # the kernels, not a fallback
    assert "0 failure(s)." in result.stdout
    assert result.stdout.count("| cuda |") == result.stdout.count("| tpu |") == len(SHIPPED)


def test_the_largest_buckets_are_lowered_and_every_executable_counted(shipped):
    _, checks = shipped
    check = checks["llama-3.1-8b-1xh200"]
    # each sampler bucket twice: without and with the structured-output token bitmask (128256 / 32 words)
    assert check["executables"] == {"forward": 70, "sampler": 70, "prompt_logprobs": 10, "decode_steps": 0,
                                   "verify_rows": 0, "verify": 0, "pooling": 0, "draft": 0}
    buckets = {(b["kind"], tuple(b["shape"])) for b in check["platforms"][0]["buckets"]}
    (sampler,) = [shape for kind, shape in buckets if kind == "sampler"]
    assert buckets == {("forward", (8192, 2048)), ("sampler", sampler), ("prompt_logprobs", (8192,))}
    assert sampler[0] == 256 and sampler[1] > 32768 and sampler[2] == 4008  # penalty histories of max_model_len+


def test_edges_are_each_ladders_ends_and_the_rungs_either_side_of_max_num_seqs():
    """On the 8B config's ladders (max_num_seqs 256), with the shapes Runner.shapes() makes of them."""
    config = EngineConfig.from_yaml(os.path.join(CONFIGS_DIR, "llama-3.1-8b-1xh200.yaml"))
    scheduler = config.scheduler_config
    ladders = BucketLadders.build(scheduler.max_num_batched_tokens, scheduler.max_num_seqs,
                                  config.model_config.max_model_len, config.cache_config.page_size,
                                  config.compilation_config.min_token_bucket, max_aux_extra=0)
    shapes = (list(itertools.product(ladders.tokens, ladders.page_widths)),
              list(itertools.product(ladders.row_buckets(), ladders.aux_widths, (0, 4008))),
              [(t,) for t in ladders.tokens], [], [], [], [(t,) for t in ladders.tokens],
              list(itertools.product(ladders.tokens, ladders.page_widths)))
    forward, sampler, prompt, *_, pool, draft = check_config.select_buckets(ladders, shapes, "edges")
    assert set(forward) == set(draft) == {(t, w) for t in (16, 256, 512, 8192) for w in (1, 2048)}
    assert {shape[0] for shape in sampler} == {16, 256} and {shape[2] for shape in sampler} == {0, 4008}
    assert {shape[1] for shape in sampler} == {0, ladders.aux_widths[1], ladders.aux_widths[-1]}
    assert set(prompt) == set(pool) == {(16,), (8192,)}
    largest = check_config.select_buckets(ladders, shapes, "largest")
    assert largest[:3] == ([(8192, 2048)], [max(shapes[1])], [(8192,)]) and largest[3:6] == ([], [], [])
    assert largest[6] == [(8192,)] and largest[7] == [(8192, 2048)]


def test_memory_estimate_of_the_8b_config_on_an_h200(shipped):
    _, checks = shipped
    check = checks["llama-3.1-8b-1xh200"]
    assert check["weight_bytes"] == 2 * 8_030_261_248  # Llama-3.1-8B's parameters in bfloat16
    assert 0 < check["activation_bytes"] < 8 * 2**30
    assert check["compile_estimate_seconds"] > 0
    memory = check["platforms"][0]["memory"]
    assert check["platforms"][0]["device"] == "h200"  # named by the config's file name
    assert memory["device_bytes"] == DEVICE_MEMORY_BYTES["h200"]
    assert memory["page_bytes"] == 2 * 32 * 16 * 8 * 128 * 2  # K and V of every layer, one page, bf16
    used = check["weight_bytes"] + check["activation_bytes"] + memory["num_pages"] * memory["page_bytes"]
    assert 0.9 * memory["device_bytes"] - memory["page_bytes"] < used <= 0.9 * memory["device_bytes"]
    assert memory["num_pages"] > 32768 // 16 + 1  # holds at least one request of max_model_len


def test_the_draft_config_counts_the_drafts_weights_pool_and_buckets(shipped):
    """llama-3.1-8b-1xh200-draft (Llama-3.2-1B drafting for the 8B) against llama-3.1-8b-1xh200: the 1B's
    weights on top (1,235,814,400 parameters in bfloat16, the embeddings tied), its page on top of the 8B's in
    every page of the pool, one proposal executable per forward bucket, its largest proposal bucket lowered."""
    _, checks = shipped
    draft, plain = checks["llama-3.1-8b-1xh200-draft"], checks["llama-3.1-8b-1xh200"]
    assert draft["weight_bytes"] - plain["weight_bytes"] == 2 * 1_235_814_400
    assert draft["executables"]["draft"] == draft["executables"]["forward"] == 70 and plain["executables"]["draft"] == 0
    cuda = draft["platforms"][0]
    assert cuda["memory"]["page_bytes"] == plain["platforms"][0]["memory"]["page_bytes"] + 2 * 16 * 16 * 8 * 64 * 2
    assert [tuple(b["shape"]) for b in cuda["buckets"] if b["kind"] == "draft"] == [(8192, 2048)]
    assert "draft model" in draft["model_note"] and draft["compile_seconds"]["draft"] > 0


def test_a_config_that_does_not_fit_its_device_fails_with_the_reason(tmp_path, monkeypatch, capsys):
    """In this process (the bundled model needs one device; its XLA flags do not matter to this check), with the
    fallback attention path a GPU takes when the kernels fail."""
    config = tmp_path / "tiny-starved.yaml"
    config.write_text("max_model_len: 512\nmax_num_seqs: 16\nmax_num_batched_tokens: 64\n"
                      "gpu_memory_utilization: 0.000001\n")
    monkeypatch.setattr(check_config, "use_host_devices", lambda count: None)
    args = build_parser().parse_args(["check-config", str(config), "--platforms", "cuda", "--buckets", "largest",
                                      "--attention-backend", "xla"])
    assert args.handler(args) == 1
    out = capsys.readouterr().out
    assert "tiny-starved cuda: memory on h100: no memory left for the KV cache" in out
    assert "| tiny-starved | cuda | xla |" in out and "| does not fit |" in out and out.count("| FAIL |") == 1


def test_a_bucket_that_fails_to_lower_is_named_with_its_error(monkeypatch):
    """In this process (the bundled model needs one device): one forward bucket's lowering raises."""
    real = check_config.lower_bucket

    def lower_bucket(function, args, platform):
        fields = {name: shape for name, shape, _ in args[-1]}  # the packed batch's layout
        if fields.get("input_ids") == (256,) and fields.get("page_table") == (16, 32):  # forward T=256, W=32
            raise RuntimeError("Mosaic cannot take this shape\nsecond line")
        return real(function, args, platform)

    monkeypatch.setattr(check_config, "lower_bucket", lower_bucket)
    config = os.path.join(CONFIGS_DIR, "tiny-cpu.yaml")
    check = check_config.check_config(config, ["tpu"], {"tpu": "tpu-v5e"}, buckets="edges")
    assert check.failures == ["tiny-cpu tpu forward (T=256, W=32): RuntimeError: Mosaic cannot take this shape"]
    assert "| FAIL |" in check_config.report([check], "edges")


def test_known_model_folders_that_are_not_here_map_to_published_configs():
    spec, note = check_config.resolve_spec("/models/Qwen2.5-7B-Instruct", None)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.qkv_bias) == (28, 4, 128, True)
    assert spec.eos_token_ids == (151645, 151643)
    assert "is not here" in note
    with pytest.raises(ValueError, match="--model-shape"):
        check_config.resolve_spec("/models/Unknown-13B", None)


def test_a_quantized_config_lowers_and_counts_its_quantized_weights(tmp_path):
    """The bundled model (one device) with fp8 weights and an fp8 KV cache: the largest buckets lower for cuda,
    the weights take their quantized bytes (the linear layers 1 byte per weight plus a float32 scale per output
    channel, the KV scales a float32 per layer and KV head; the tied embeddings stay float32), and a KV page is a
    quarter of a float32 page. (The unquantized config speculates, so its verification bucket is lowered too.)"""
    checks = {}
    for mode, kv_cache_dtype, extra in (("none", "auto", "speculative_config: {method: ngram}\n"), ("fp8", "fp8", "")):
        config = tmp_path / f"tiny-{mode}-{kv_cache_dtype}.yaml"
        config.write_text(f"max_model_len: 256\nmax_num_seqs: 8\nmax_num_batched_tokens: 32\nquantization: {mode}\n"
                          f"kv_cache_dtype: {kv_cache_dtype}\n{extra}")
        checks[mode] = check_config.check_config(str(config), ["cuda"], {"cuda": "h100"}, buckets="largest",
                                                 attention_backend="xla")
    assert checks["fp8"].failures == [] and checks["none"].failures == []
    assert checks["none"].executables["verify"] > 0 and checks["fp8"].executables["verify"] == 0
    assert checks["none"].executables["verify_rows"] == checks["none"].executables["prompt_logprobs"]
    kinds = [b.kind for b in checks["none"].platforms[0].buckets]
    assert kinds.count("verify") == kinds.count("verify_rows") == 1
    plans = {mode: check.platforms[0].memory for mode, check in checks.items()}
    assert plans["fp8"].page_bytes * 4 == plans["none"].page_bytes
    assert plans["fp8"].num_pages >= 4 * plans["none"].num_pages - 4
    hidden, inner, layers, heads, kv_heads, head_dim = 128, 384, 4, 4, 2, 32  # the bundled model's shape
    linear = layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inner)
    scales = layers * ((heads + 2 * kv_heads) * head_dim + hidden + 2 * inner + hidden)
    kv_scales = 2 * layers * kv_heads  # k_scale and v_scale (L, Hkv)
    assert checks["none"].weight_bytes - checks["fp8"].weight_bytes == linear * 4 - linear - (scales + kv_scales) * 4


def test_a_lora_config_counts_its_adapter_slots(tmp_path):
    """The bundled model with 3 LoRA slots of rank 8: the largest buckets lower for cuda with the slots in
    every projection, and the weights grow by exactly the slots' bytes (a (S, in, R) and b (S, R, out) float32 per
    projection and layer)."""
    checks = {}
    for lora in (False, True):
        config = tmp_path / f"tiny-lora-{lora}.yaml"
        config.write_text("max_model_len: 256\nmax_num_seqs: 8\nmax_num_batched_tokens: 32\n"
                          + ("enable_lora: true\nmax_loras: 3\nmax_lora_rank: 8\n" if lora else ""))
        checks[lora] = check_config.check_config(str(config), ["cuda"], {"cuda": "h100"}, buckets="largest")
    assert checks[True].failures == [] and checks[False].failures == []
    hidden, inner, layers, q_width, kv_width = 128, 384, 4, 128, 64  # the bundled model's shape
    widths = [(hidden, q_width), (hidden, kv_width), (hidden, kv_width), (q_width, hidden), (hidden, inner),
              (hidden, inner), (inner, hidden)]
    slots_bytes = layers * sum(3 * (width_in + width_out) * 8 for width_in, width_out in widths) * 4
    assert checks[True].weight_bytes - checks[False].weight_bytes == slots_bytes


def test_a_pooling_config_lowers_its_pooling_buckets(tmp_path):
    """runner pooling (embeddings): a pooling executable per token rung summing its rows, and one more per rung that
    has more tokens than rows keeping the tokens apart (token-wise tasks); the largest lowered for cuda and tpu."""
    config = tmp_path / "tiny-pooling.yaml"
    config.write_text("max_model_len: 256\nmax_num_seqs: 8\nmax_num_batched_tokens: 32\nrunner: pooling\n")
    check = check_config.check_config(str(config), ["cuda", "tpu"], {"cuda": "h100", "tpu": "tpu-v5e"},
                                      buckets="largest")
    assert check.failures == []
    rungs = check.executables["prompt_logprobs"]  # one per token rung
    assert rungs < check.executables["pooling"] < 2 * rungs  # the rungs of up to max_num_seqs tokens: one each
    for platform in check.platforms:
        assert [b.shape for b in platform.buckets if b.kind == "pooling"] == [(32, 32)]





def _eagle_head_bytes(method: str) -> tuple[int, int]:
    """(weight bytes, page bytes) the test heads add to their float32 targets (both: H 64, I 128, 4 heads, 2 KV
    heads of 16, V 512): EAGLE-1's fc over 2H with its bias, one layer without its input norm, an embedding, a
    feature of H per token; EAGLE-3's fc over 3H, a layer whose attention reads 2H with three norms, its final
    norm, LM head over 96 draft tokens and their int32 target ids, an embedding, three layers' inputs per token."""
    hidden, inner, heads, kv_heads, head_dim, vocab, draft_vocab, page = 64, 128, 4, 2, 16, 512, 96, 16
    attention_in, mlp = heads + 2 * kv_heads, 3 * hidden * inner
    head_kv = page * 2 * kv_heads * head_dim * 4  # a page of the head's one layer
    if method == "eagle":
        layer = hidden * attention_in * head_dim + heads * head_dim * hidden + mlp + hidden
        return (2 * hidden * hidden + hidden + layer + vocab * hidden) * 4, page * hidden * 4 + head_kv
    layer = 2 * hidden * attention_in * head_dim + heads * head_dim * hidden + mlp + 3 * hidden
    head = 3 * hidden * hidden + layer + hidden + hidden * draft_vocab + vocab * hidden
    return head * 4 + draft_vocab * 4, page * 3 * hidden * 4 + head_kv


@pytest.mark.parametrize("method, target, head", [("eagle", "llama", "llama-eagle"),
                                                  ("eagle3", "gemma2", "gemma2-eagle3")])
def test_an_eagle_config_lowers_the_head_and_counts_its_weights_and_features(tmp_path, method, target, head):
    """A test checkpoint with its EAGLE head: the largest buckets (the head's proposal bucket among them; for
    EAGLE-3, the target's forward giving three layers' inputs) lower for cuda and tpu; the weights grow by the
    head's, and each KV page by its tokens' features beside the target's KV and the head's own KV."""
    from helpers import checkpoint

    checks = {}
    for eagle in (False, True):
        config = tmp_path / f"{head}-{eagle}.yaml"
        speculative = f"speculative_config: {{method: {method}, model: {checkpoint(head)}}}\n" if eagle else ""
        config.write_text(f"model: {checkpoint(target)}\nmax_model_len: 128\nmax_num_seqs: 8\n"
                          f"max_num_batched_tokens: 32\n{speculative}")
        checks[eagle] = check_config.check_config(str(config), ["cuda", "tpu"], {"cuda": "h100", "tpu": "tpu-v5e"},
                                                  buckets="largest", attention_backend="xla")
    assert checks[True].failures == [] and checks[False].failures == []
    assert checks[True].executables["draft"] == checks[True].executables["forward"] > 0
    assert "EAGLE head" in checks[True].model_note
    weight_bytes, page_bytes = _eagle_head_bytes(method)
    assert checks[True].weight_bytes - checks[False].weight_bytes == weight_bytes
    for plain, eagle in zip(checks[False].platforms, checks[True].platforms):
        assert "draft" in [b.kind for b in eagle.buckets]
        assert eagle.memory.page_bytes - plain.memory.page_bytes == page_bytes
