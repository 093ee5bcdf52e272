"""Typed configs keep what users wrote working: every YAML key, keyword argument and flag of the flat EngineConfig
(snapshotted below from jaxserve before the parts, commit a2b976c) is still accepted with the same meaning, and the
command line"s help is made from the options" own documentation."""

import argparse
import json

import pytest
import yaml

from jaxserve.cli import GENERATE_DEFAULTS, SERVE_DEFAULTS, _engine_config, build_parser
from jaxserve.config import OPTION_NAMES, EngineConfig

# EngineConfig"s fields before it had parts: its keyword arguments and YAML keys.
TODAY_OPTIONS = (
    "model", "tokenizer", "dtype", "max_model_len", "page_size", "num_pages", "gpu_memory_utilization",
    "cpu_kv_cache_gib", "max_num_seqs", "max_num_batched_tokens", "min_token_bucket", "enable_chunked_prefill",
    "enable_prefix_caching", "scheduling_policy", "tensor_parallel_size", "enable_expert_parallel",
    "enable_structured_outputs", "reasoning_parser", "structured_outputs_in_reasoning", "reasoning_config",
    "logprobs_mode", "attention_backend", "seed", "compilation_cache_dir", "skip_precompile", "background_compile",
    "generation_config", "batching", "load_format", "async_scheduling", "num_scheduler_steps", "preemption_mode",
    "swap_space", "max_preemptions", "speculative_config", "quantization", "kv_cache_dtype", "calculate_kv_scales",
    "distributed_coordinator", "num_processes", "process_id", "distributed_timeout_s", "data_parallel_size",
    "enable_lora", "max_loras", "max_lora_rank", "lora_modules", "runner", "pooler_config", "enable_sleep_mode",
    "min_page_bucket",
)
# the engine flags `jaxserve generate` and `jaxserve serve` both took
TODAY_ENGINE_FLAGS = (
    "--model", "--config", "--tokenizer", "--dtype", "--max-model-len", "--page-size", "--num-pages",
    "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--enable-prefix-caching", "--no-enable-prefix-caching", "--scheduling-policy",
    "--tensor-parallel-size", "--enable-structured-outputs", "--no-enable-structured-outputs",
    "--reasoning-parser", "--structured-outputs-in-reasoning", "--no-structured-outputs-in-reasoning",
    "--reasoning-config", "--logprobs-mode", "--enable-lora", "--no-enable-lora", "--max-loras", "--max-lora-rank",
    "--lora-modules", "--enable-expert-parallel", "--no-enable-expert-parallel", "--attention-backend", "--seed",
    "--compilation-cache-dir", "--skip-precompile", "--no-skip-precompile", "--background-compile",
    "--no-background-compile", "--cpu-kv-cache-gib", "--min-token-bucket", "--generation-config", "--batching",
    "--quantization", "--kv-cache-dtype", "--calculate-kv-scales", "--no-calculate-kv-scales", "--load-format",
    "--async-scheduling", "--no-async-scheduling", "--num-scheduler-steps", "--preemption-mode", "--swap-space",
    "--speculative-config", "--enable-sleep-mode", "--no-enable-sleep-mode", "--runner", "--pooler-config",
    "--distributed-coordinator", "--num-processes", "--process-id", "--distributed-timeout-s",
    "--data-parallel-size", "--max-preemptions",
    "--min-page-bucket",
)
TODAY_SERVE_ONLY_FLAGS = (
    "--host", "--port", "--api-key", "--served-model-name", "--max-waiting-requests", "--max-n", "--max-prompts",
    "--max-body-bytes", "--metrics-prefix", "--stream-interval", "--enable-tokenizer-info-endpoint",
    "--tool-call-parser", "--enable-auto-tool-choice", "--chat-template", "--allowed-origins", "--allowed-methods",
    "--allowed-headers", "--allow-credentials", "--allow-runtime-lora-updating", "--max-stored-responses",
    "--enable-weight-updates", "--enable-server-load-tracking", "--enable-force-include-usage",
    "--return-tokens-as-token-ids", "--enable-prompt-tokens-details", "--ssl-keyfile", "--ssl-certfile",
    "--ssl-ca-certs", "--ssl-cert-reqs", "--root-path", "--log-level", "--disable-dashboard",
    "--timeout-keep-alive",
)
TODAY_GENERATE_ONLY_FLAGS = (
    "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--sample-seed",
)
# A value of each option other than its default, with the options it needs beside it.
SAMPLES = {
    "model": ("/models/llama", {}),
    "tokenizer": ("/models/tokenizer", {}),
    "dtype": ("bfloat16", {}),
    "max_model_len": (256, {}),
    "page_size": (32, {}),
    "num_pages": (100, {}),
    "gpu_memory_utilization": (0.5, {}),
    "cpu_kv_cache_gib": (0.25, {}),
    "max_num_seqs": (8, {}),
    "max_num_batched_tokens": (256, {}),
    "min_token_bucket": (16, {}),
    "min_page_bucket": (4, {}),
    "enable_chunked_prefill": (False, {}),
    "enable_prefix_caching": (False, {}),
    "scheduling_policy": ("priority", {}),
    "tensor_parallel_size": (2, {}),
    "enable_expert_parallel": (True, {}),
    "enable_structured_outputs": (False, {}),
    "reasoning_parser": ("qwen3", {}),
    "structured_outputs_in_reasoning": (True, {}),
    "reasoning_config": ({"reasoning_end_str": "Done.</think>"}, {}),
    "logprobs_mode": ("processed_logprobs", {}),
    "attention_backend": ("xla", {}),
    "seed": (7, {}),
    "compilation_cache_dir": ("/tmp/xla-cache", {}),
    "skip_precompile": (True, {}),
    "background_compile": (True, {}),
    "generation_config": ("vllm", {}),
    "batching": ("static", {}),
    "load_format": ("dummy", {}),
    "async_scheduling": (False, {}),
    "num_scheduler_steps": (4, {}),
    "preemption_mode": ("swap", {}),
    "swap_space": (2.0, {}),
    "max_preemptions": (5, {}),
    "speculative_config": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 4}, {}),
    "quantization": ("int8", {}),
    "kv_cache_dtype": ("fp8", {}),
    "calculate_kv_scales": (True, {"kv_cache_dtype": "fp8"}),
    "distributed_coordinator": ("10.0.0.1:8476", {"num_processes": 2}),
    "num_processes": (2, {"distributed_coordinator": "10.0.0.1:8476"}),
    "process_id": (1, {"distributed_coordinator": "10.0.0.1:8476", "num_processes": 2}),
    "distributed_timeout_s": (90.0, {}),
    "data_parallel_size": (2, {}),
    "enable_lora": (True, {}),
    "max_loras": (3, {}),
    "max_lora_rank": (8, {}),
    "lora_modules": ({"alpha": "/adapters/alpha"}, {"enable_lora": True}),
    "runner": ("pooling", {}),
    "pooler_config": ({"pooling_type": "MEAN", "normalize": False}, {}),
    "enable_sleep_mode": (True, {}),
}


def subparser(command: str) -> argparse.ArgumentParser:
    """The parser of one `jaxserve` command."""
    (commands,) = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return commands.choices[command]


def flag_args(name: str, value) -> list[str]:
    """The command-line form of one option's value."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else flag.replace("--", "--no-", 1)]
    if name == "lora_modules":
        return [flag, *(f"{key}={path}" for key, path in value.items())]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def test_every_option_of_today_is_still_an_option_with_a_sample():
    assert set(TODAY_OPTIONS) <= set(OPTION_NAMES)
    assert set(SAMPLES) == set(OPTION_NAMES)  # a new option gets a sample here, so it is checked below too


@pytest.mark.parametrize("name", TODAY_OPTIONS)
def test_a_keyword_argument_and_a_yaml_key_keep_their_meaning(name, tmp_path):
    value, companions = SAMPLES[name]
    assert EngineConfig().options()[name] != value  # the sample moves the option off its default
    assert EngineConfig(**{name: value, **companions}).options()[name] == value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({name: value, **companions}))
    assert EngineConfig.from_yaml(str(path)).options()[name] == value


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("name", TODAY_OPTIONS)
def test_a_flag_keeps_its_meaning_on_both_commands(name, command, tmp_path):
    """Every engine flag is accepted by both commands (generate's help hides those that do not apply to it)."""
    value, companions = SAMPLES[name]
    (tmp_path / "empty.yaml").write_text("")
    argv = [command, "--config", str(tmp_path / "empty.yaml"), *flag_args(name, value)]
    for other, other_value in companions.items():
        argv += flag_args(other, other_value)
    if command == "generate":
        argv += ["--prompt", "hi"]
    args = build_parser().parse_args(argv)
    assert _engine_config(args).options()[name] == value


def test_every_flag_of_today_is_still_accepted():
    serve, generate = (set(subparser(command)._option_string_actions) for command in ("serve", "generate"))
    assert set(TODAY_ENGINE_FLAGS) | set(TODAY_SERVE_ONLY_FLAGS) <= serve
    assert set(TODAY_ENGINE_FLAGS) | set(TODAY_GENERATE_ONLY_FLAGS) <= generate


def test_serve_help_shows_every_flags_default():
    parser = subparser("serve")
    formatter = parser._get_formatter()
    shown = [action for action in parser._actions if action.option_strings and action.help != argparse.SUPPRESS
             and "--help" not in action.option_strings]
    assert len(shown) >= len(TODAY_ENGINE_FLAGS) // 2 + 30  # the engine's flags and the server's own
    missing = [action.option_strings[0] for action in shown if "(default: " not in formatter._get_help_string(action)]
    assert missing == []


def test_help_is_made_from_the_options_own_documentation():
    for command, defaults in (("serve", SERVE_DEFAULTS), ("generate", GENERATE_DEFAULTS)):
        actions = {action.dest: action for action in subparser(command)._actions}
        for option in EngineConfig.option_docs():
            if command in option.doc.commands:
                assert actions[option.name].help.startswith(option.doc.help), option.name
    generate, serve = (subparser(command).format_help() for command in ("generate", "serve"))
    assert "each bucket at its first use" in generate and "(default: on)" in _flag_help(generate, "--skip-precompile")
    assert "(default: off)" in _flag_help(serve, "--skip-precompile")
    assert "(default: on)" in _flag_help(serve, "--background-compile")


def test_generate_help_shows_only_what_applies_to_one_prompt():
    generate, serve = (subparser(command).format_help() for command in ("generate", "serve"))
    for flag in ("--max-loras", "--data-parallel-size", "--reasoning-parser", "--scheduling-policy", "--runner"):
        assert flag in serve and flag not in generate
    for flag in ("--model", "--max-model-len", "--page-size", "--speculative-config", "--skip-precompile"):
        assert flag in generate
    assert "model options" in generate and "lora options" in serve and "lora options" not in generate


def test_a_misspelled_option_names_the_one_meant():
    with pytest.raises(ValueError, match="max_num_seq \\(did you mean max_num_seqs\\?\\)"):
        EngineConfig(max_num_seq=4)
    with pytest.raises(ValueError, match="unknown option"):
        EngineConfig(max_num_seqs=4).replace(page_sise=8)


def test_each_part_checks_itself_and_the_engine_checks_across_parts():
    with pytest.raises(ValueError, match="page_size must be one of 8, 16, 32"):
        EngineConfig(page_size=12)
    with pytest.raises(ValueError, match="num_scheduler_steps > 1 are alternatives"):
        EngineConfig(speculative_config={"method": "ngram"}, num_scheduler_steps=2)
    config = EngineConfig(speculative_config='{"model": "/draft"}', max_num_seqs=8)
    assert config.speculative_config.method == "draft_model" and config.num_speculative_tokens == 3
    assert config.replace(max_num_seqs=4).scheduler_config.max_num_seqs == 4
    assert config.replace(max_num_seqs=4).speculative_config == config.speculative_config


def _flag_help(help_text: str, flag: str) -> str:
    """One flag's entry in a --help text: from the flag to the next flag's line."""
    start = help_text.index("  " + flag)
    end = help_text.find("\n  --", start + 1)
    return " ".join(help_text[start:end].split())
