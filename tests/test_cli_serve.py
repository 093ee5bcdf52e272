"""`jaxserve serve`: config files and flags, clear errors for bad options, and a real launch."""

import argparse
import glob
import http.client
import os
import resource
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from helpers import TEST_CACHE_DIR, http_client, small_engine_args

from benchmarks.disconnect_soak import child_processes, running
from jaxserve.cli import main, uvicorn_options
from jaxserve.config import CONFIGS_DIR, EngineConfig
from jaxserve.server.front_ends import OPEN_FILES_RESERVED, connection_limit

TLS = os.path.join(os.path.dirname(__file__), "fixtures", "tls")
CERTIFICATE = os.path.join(TLS, "cert.pem")
TRUSTED = ssl.create_default_context(cafile=CERTIFICATE)  # a client that trusts the test certificate


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS_DIR, "*.yaml"))), ids=os.path.basename)
def test_shipped_configs_are_valid(path):
    config = EngineConfig.from_yaml(path)
    assert config.scheduler_config.max_num_seqs <= config.scheduler_config.max_num_batched_tokens


def test_the_gpu_configs_ship():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS_DIR, "*.yaml"))}
    assert {"tiny-cpu.yaml", "llama-3.1-8b-1xh200.yaml", "llama-3.1-8b-1xh200-draft.yaml", "llama-3.1-70b-8xh200.yaml",
            "qwen2.5-7b-1xh100.yaml"} <= names
    seventy_b = EngineConfig.from_yaml(os.path.join(CONFIGS_DIR, "llama-3.1-70b-8xh200.yaml"))
    assert seventy_b.parallel_config.tensor_parallel_size == 8


def test_unknown_config_key_is_an_error_listing_the_valid_ones(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("max_num_seq: 4\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", str(path)])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "unknown option(s) max_num_seq" in message and "max_num_seqs" in message and "page_size" in message


def test_bad_flags_exit_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--generation-config", "/no/such/folder"])
    assert exit_info.value.code == 2
    assert "generation_config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--page-size", "12"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--timeout-keep-alive", "0"])
    assert "timeout_keep_alive must be >= 1, got 0" in capsys.readouterr().err


def test_skip_precompile_is_a_flag_and_a_yaml_key_and_must_be_a_bool(tmp_path):
    from jaxserve.cli import _engine_config, build_parser

    lazy = _engine_config(build_parser().parse_args(["serve", "--skip-precompile"]))
    assert lazy.compilation_config.skip_precompile is True
    path = tmp_path / "lazy.yaml"
    path.write_text("skip_precompile: true\n")
    assert EngineConfig.from_yaml(str(path)).compilation_config.skip_precompile is True
    with pytest.raises(ValueError, match="skip_precompile must be true or false, got 'yes'"):
        EngineConfig(skip_precompile="yes")


def test_serve_without_the_server_packages_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if `pip install jaxserve` without [serve]
    with pytest.raises(SystemExit) as exit_info:
        main(["serve"])
    assert exit_info.value.code == 2
    assert "pip install 'jaxserve[serve]'" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_starts_from_a_config_and_flags_override_it(tmp_path):
    """A real launch from a YAML file and flags over it, serving HTTPS (the test certificate of 127.0.0.1,
    tests/fixtures/tls/, made with openssl) under a proxy's root path, the model under two names."""
    options = small_engine_args(max_num_seqs=4)  # the file says 4; the flag below says 32
    options.pop("show_progress")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(options))
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "JAXSERVE_API_KEY": "env-key", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "jaxserve", "serve", "--config", str(config), "--max-num-seqs", "32",
               "--port", str(port), "--compilation-cache-dir", TEST_CACHE_DIR, "--skip-precompile",
               "--ssl-keyfile", os.path.join(TLS, "key.pem"), "--ssl-certfile", CERTIFICATE, "--root-path", "/api",
               "--served-model-name", "tiny-stdlib-llama", "tiny", "--timeout-keep-alive", "1"]
    with open(log, "w") as log_file:
        # 300 open files at most (the shell's ulimit, then exec: no fork hook in this threaded process): connections
        # past 300 - OPEN_FILES_RESERVED are answered 503
        process = subprocess.Popen(["bash", "-c", f"ulimit -n 300 && exec {shlex.join(command)}"], stdout=log_file,
                                   stderr=subprocess.STDOUT, env=env)
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", verify=TRUSTED).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        text = log.read_text()
        assert "serving 'tiny-stdlib-llama'" in text and f"https://127.0.0.1:{port}/api " in text
        assert "max_num_seqs 32" in text and "API key required" in text
        assert httpx.get(f"{url}/v1/models", verify=TRUSTED).status_code == 401
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            http_client.get(f"{url}/health")  # a client that does not trust the certificate
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer env-key"}, verify=TRUSTED).json()
        assert [card["id"] for card in models["data"]] == ["tiny-stdlib-llama", "tiny"]  # the first, then aliases
        assert models["data"][0]["max_model_len"] == 128
        tokens = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "def"}, verify=TRUSTED)
        assert tokens.status_code == 200 and tokens.json()["tokens"], tokens.text
        assert httpx.post(f"{url}/tokenize", json={"model": "nope", "prompt": "def"}, verify=TRUSTED).status_code == 404
        # a kept-alive connection serves again while idle less than --timeout-keep-alive, and is closed after it
        kept = http.client.HTTPSConnection("127.0.0.1", port, context=TRUSTED)
        for idle_s in (0.0, 0.5):
            time.sleep(idle_s)
            kept.request("GET", "/health")
            response = kept.getresponse()
            assert response.status == 200 and not response.will_close
            response.read()
        time.sleep(2.5)
        kept.sock.settimeout(1.5)  # closed by 4 s idle: before uvicorn's own default (5 s) would close it
        assert kept.sock.recv(1) == b""
        kept.close()
        assert "the open files limit is 300 (its hard limit 300)" in log.read_text()
        held = [TRUSTED.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
                for _ in range(connection_limit(300))]
        assert httpx.get(f"{url}/health", verify=TRUSTED).status_code == 503  # not a process out of descriptors
        for connection in held:
            connection.close()
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health", verify=TRUSTED).status_code != 200:
            assert time.monotonic() < deadline, "the closed connections still count"
            time.sleep(0.1)
        cores = child_processes(process.pid)  # the engine core's (and multiprocessing's resource tracker)
        assert cores
    finally:
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(timeout=30) == 130  # Ctrl-C's status (jaxserve/console.py)
            assert "jaxserve: interrupted" in log.read_text() and "Traceback" not in log.read_text()
        finally:
            process.kill()
    # Ctrl-C ends the server at once, with no shutdown of its own (as a kill would): its engine core goes with it
    assert not any(running(pid) for pid in cores), log.read_text()


def test_serve_raises_its_open_files_limit_to_the_hard_limit_and_warns_when_that_is_low():
    """Each connection holds a file descriptor: under Linux's usual soft limit (1024) a thousand streams would fail.
    In a process of its own (a hard limit, once lowered, stays lowered)."""
    code = ("import logging, resource\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048))\n"
            "from jaxserve.server.front_ends import raise_open_files_limit\n"
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2048", "2048"]  # the hard limit, under OPEN_FILES_WANTED
    assert "raised the open files limit from 256 to 2048" in result.stderr
    # under OPEN_FILES_LOW: a warning
    assert "the open files limit is 2048 (its hard limit 2048): connections past 1792 at once are answered 503" in \
        result.stderr
    assert connection_limit(2048) == 2048 - OPEN_FILES_RESERVED and connection_limit(resource.RLIM_INFINITY) is None


def test_tls_flags_go_to_uvicorn_together_or_are_refused(tmp_path):
    def parse(*flags) -> argparse.Namespace:
        return argparse.Namespace(**{"ssl_keyfile": None, "ssl_certfile": None, "ssl_ca_certs": None,
                                     "ssl_cert_reqs": 0, "root_path": "", **dict(flags)})

    key = os.path.join(TLS, "key.pem")
    assert uvicorn_options(parse()) == {"root_path": ""}
    assert uvicorn_options(parse(("ssl_keyfile", key), ("ssl_certfile", CERTIFICATE), ("ssl_ca_certs", CERTIFICATE),
                                 ("ssl_cert_reqs", 2), ("root_path", "/v"))) == {
        "root_path": "/v", "ssl_keyfile": key, "ssl_certfile": CERTIFICATE, "ssl_ca_certs": CERTIFICATE,
        "ssl_cert_reqs": 2}
    with pytest.raises(ValueError, match="TLS needs both --ssl-keyfile and --ssl-certfile"):
        uvicorn_options(parse(("ssl_certfile", CERTIFICATE)))
    with pytest.raises(ValueError, match="--ssl-keyfile '.*missing.pem' is not a file"):
        uvicorn_options(parse(("ssl_keyfile", str(tmp_path / "missing.pem")), ("ssl_certfile", CERTIFICATE)))
    with pytest.raises(ValueError, match="--ssl-ca-certs and --ssl-cert-reqs check clients' certificates"):
        uvicorn_options(parse(("ssl_cert_reqs", 2)))
