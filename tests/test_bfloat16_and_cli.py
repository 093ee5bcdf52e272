"""bfloat16 weights and KV pages; the `jaxserve generate` command line."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.cli import _engine_config, build_parser, main
from helpers import checkpoint, expected, small_engine_args


def test_bfloat16_engine_agrees_with_hf_float32_on_the_first_token():
    llm = LLM(checkpoint("qwen3"), dtype="bfloat16", **small_engine_args(skip_precompile=True))
    runner = llm.engine.core.runner
    assert runner.params["embed"].dtype == np.dtype("bfloat16") and runner.kv_caches[0].dtype == np.dtype("bfloat16")
    want = expected("qwen3")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in want["prompts"]], params, use_tqdm=False)
    for result, hf_tokens, logits in zip(outputs, want["outputs"], want["logits"]):
        token = result.outputs[0].token_ids[0]
        assert token == hf_tokens[0]
        hf_logprob = logits[token] - np.logaddexp.reduce(logits.astype(np.float64))
        assert result.outputs[0].logprobs[0][token].logprob == pytest.approx(hf_logprob, abs=0.1)


def test_generate_command_streams_the_completion(capsys):
    engine_flags = {"max_model_len": 64, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    args = ["generate", "--model", checkpoint("llama"), "--prompt", "def add(a, b):", "--max-tokens", "6"]
    for key, value in engine_flags.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    assert main(args + ["--skip-precompile"]) == 0
    printed = capsys.readouterr().out
    # The same engine options through the Python API give the same greedy text.
    llm = LLM(checkpoint("llama"), show_progress=False, skip_precompile=True, **engine_flags)
    (result,) = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(result.outputs[0].token_ids) == 6
    assert printed == "def add(a, b):" + result.outputs[0].text + "\n"


def test_generate_command_reports_bad_options_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "/no/such/folder", "--prompt", "x"])
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_compiles_at_first_use_unless_a_flag_or_the_config_file_says(tmp_path):
    """`generate` meets a few buckets: they compile at their first use, unless the user chose otherwise."""
    def config(*flags):
        args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
        return _engine_config(args, skip_precompile=True)

    assert config().compilation_config.skip_precompile
    assert not config("--no-skip-precompile").compilation_config.skip_precompile
    path = tmp_path / "engine.yaml"
    path.write_text("skip_precompile: false\n")
    assert not config("--config", str(path)).compilation_config.skip_precompile
    path.write_text("max_num_seqs: 4\n")
    assert config("--config", str(path)).compilation_config.skip_precompile
    serve = build_parser().parse_args(["serve"])
    assert not _engine_config(serve).compilation_config.skip_precompile  # serve compiles every bucket before it answers
