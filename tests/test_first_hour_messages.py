"""What a new user meets first (issue 50): no line from another library that reads as a fault on any command of an
install without torch (the server answering the README's curl and `openai` examples meanwhile), config-file mistakes
answered in one line that says what to fix, and plain messages for a sampling bound and a missing weights folder."""

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest
from helpers import FAST_COMPILE_XLA_FLAG, TEST_CACHE_DIR, http_client, markdown_blocks, pythonpath_without_torch

from benchmarks.disconnect_soak import child_processes, running
from jaxserve.bench.online import free_port, healthy, stop_process
from jaxserve.config import EngineConfig
from jaxserve.config.engine import DEFAULT_MODEL_CONFIG, shipped_configs
from jaxserve.model.loader import SafetensorsFolder
from jaxserve.sampling_params import SamplingParams

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
README_URL = "http://127.0.0.1:8000"  # where the README's examples find the server
# Lines of other libraries that tell a user something is broken when nothing is
NOISE = ("PyTorch was not found", "libtpu", "Unable to initialize backend", "Traceback", "indexing errors")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": pythonpath_without_torch(os.getcwd()), "JAX_PLATFORMS": "",
            "XLA_FLAGS": FAST_COMPILE_XLA_FLAG}


def _quiet(stderr: str) -> None:
    assert not [line for line in stderr.splitlines() if any(noise in line for noise in NOISE)], stderr


def test_torch_is_hidden_by_the_fixture():
    probe = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('torch'))"],
                           capture_output=True, text=True, env=_env(), check=True)
    assert probe.stdout.strip() == "None"


@pytest.mark.parametrize("command", [
    ["-c", "import jaxserve, jaxserve.tokenizer, transformers"],
    ["-m", "jaxserve", "--help"],
    ["-m", "jaxserve", "generate", "--prompt", "def fibonacci(n):", "--compilation-cache-dir", TEST_CACHE_DIR],
])
def test_commands_say_nothing_of_other_libraries_without_torch(command):
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    _quiet(result.stderr)
    if "generate" in command:  # the README's quick start: it shows what this prints
        assert result.stdout.rstrip("\n") == _readme_sample_output()


def _readme_sample_output() -> str:
    """The README's sample of what `jaxserve generate --prompt "def fibonacci(n):"` prints."""
    text = open(README, encoding="utf-8").read()
    assert 'jaxserve generate --prompt "def fibonacci(n):"' in text
    after = text.split("64 greedy tokens after it", 1)[1]
    return after.split("```\n", 1)[1].split("\n```", 1)[0]


def test_serve_answers_the_readme_examples_without_a_word_from_other_libraries(tmp_path):
    log = tmp_path / "serve.log"
    port = free_port()
    with open(log, "w") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "jaxserve", "serve", "--port", str(port), "--skip-precompile",
                                   "--compilation-cache-dir", TEST_CACHE_DIR], stdout=log_file,
                                  stderr=subprocess.STDOUT, env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not healthy(url):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        _run_readme_server_examples(url)
        too_long = {"model": "tiny-stdlib-llama", "prompt": "x " * 600, "max_tokens": 2}  # refused: 400
        assert http_client.post(f"{url}/v1/completions", json=too_long).status_code == 400
        children = child_processes(server.pid)
    finally:
        stop_process(server, grace_s=60)
    assert not any(running(pid) for pid in children)
    text = log.read_text()
    assert "serving 'tiny-stdlib-llama'" in text and "weights: 5.0 MiB (not quantized)" in text
    _quiet(text)


def _run_readme_server_examples(url: str) -> None:
    """The README's curl command and its `openai` client example, as written but for the server's port."""
    (curl,) = [code for _, code in markdown_blocks(README, "bash") if code.startswith("curl ")]
    args = shlex.split(curl.replace(README_URL, url).replace("\\\n", " "))
    if shutil.which("curl"):
        answer = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    else:  # the same request without curl: its URL, header and body
        answer = http_client.post(args[1], content=args[args.index("-d") + 1],
                                  headers=dict([args[args.index("-H") + 1].split(": ")]), timeout=120).text
    assert json.loads(answer)["choices"][0]["text"]
    (client,) = [code for _, code in markdown_blocks(README, "python") if "OpenAI(" in code]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(client.replace(README_URL, url), {})
    assert printed.getvalue()  # the streamed text


def _cli_error(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "jaxserve", "generate", *args, "--prompt", "x"],
                            capture_output=True, text=True, env=_env(), timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    return lines[0]


def test_config_file_mistakes_get_one_line_that_says_what_to_fix(tmp_path):
    assert _cli_error("--config", "nope.yaml") == (
        "jaxserve: error: no config file nope.yaml; the shipped configs, named without a path (`jaxserve check-config "
        "--list` says what each is for): gpt-oss-20b-1xh200, "
        "llama-3.1-70b-8xh200, llama-3.1-8b-1xh200, llama-3.1-8b-1xh200-draft, qwen2.5-7b-1xh100, tiny-cpu")
    malformed = tmp_path / "bad.yaml"
    malformed.write_text("max_model_len: [1, 2\n")
    assert _cli_error("--config", str(malformed)) == (
        f"jaxserve: error: the config file {malformed} is not valid YAML at line 2, column 1: expected ',' or ']', "
        "but got '<stream end>'")
    misspelled = tmp_path / "typo.yaml"
    misspelled.write_text("max_num_seq: 4\n")
    assert "did you mean max_num_seqs?" in _cli_error("--config", str(misspelled))


PARSE_ONLY = """
import sys
from jaxserve.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    print(done.code, sorted({name.split(".")[0] for name in sys.modules} & {"jax", "transformers", "torch"}))
"""


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"],
                                  ["generate", "--prompt", "x", "--config", "nope.yaml"],
                                  ["serve", "--max-num-seqs", "many"]])
def test_the_command_line_answers_help_and_wrong_options_without_importing_jax(argv):
    """`jaxserve --help` and a wrong option answer at once: parsing imports none of jax, transformers, torch."""
    result = subprocess.run([sys.executable, "-c", PARSE_ONLY, *argv], capture_output=True, text=True, env=_env(),
                            timeout=120)
    code, imported = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert (code, imported) == ("0" if "--help" in argv else "2", "[]"), result.stdout + result.stderr


def test_the_slow_commands_are_listed_and_parse_with_their_flags():
    """bench and check-config, whose modules import jax, are in `jaxserve --help`, and their flags are there when
    the command line names them."""
    from jaxserve.cli import build_parser

    (commands,) = [a for a in build_parser("")._actions if isinstance(a, argparse._SubParsersAction)]
    assert {"generate", "serve", "bench", "convert", "check-config"} <= set(commands.choices)
    assert build_parser("check-config").parse_args(["check-config", "tiny-cpu", "--buckets", "largest"]).buckets \
        == "largest"
    assert build_parser("bench").parse_args(["bench", "effects", "--repeats", "1"]).repeats == 1


def test_a_command_lists_the_shipped_configs():
    result = subprocess.run([sys.executable, "-m", "jaxserve", "check-config", "--list"], capture_output=True,
                            text=True, env=_env(), timeout=120, check=True)
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert names == shipped_configs() and "tiny-cpu" in names
    assert "The bundled tiny model" in result.stdout  # each with its file's first comment


@pytest.mark.parametrize("name", ["tiny-cpu", "tiny-cpu.yaml", "configs/tiny-cpu.yaml"])
def test_shipped_configs_are_reached_by_name_from_anywhere(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the clone's root: no configs/ here
    assert EngineConfig.from_yaml(name) == EngineConfig.from_yaml(DEFAULT_MODEL_CONFIG)


def test_plain_messages_for_bounds_and_missing_folders(tmp_path):
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0.0, got -1.$"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"^top_p must be a finite number in \(0.0, 1.0\], got 2.$"):
        SamplingParams(top_p=2)
    missing = str(tmp_path / "next-checkpoint")  # update_weights' folder, mistyped
    with pytest.raises(ValueError, match="does not exist"):
        SafetensorsFolder(missing)
    with pytest.raises(ValueError, match=r"^no \*.safetensors weights in model folder"):
        SafetensorsFolder(str(tmp_path))
