"""A regular (non-editable) install works: build the wheel from the repository's files, install it
into a fresh virtual environment and run `jaxserve generate` on the bundled model from a folder
outside the repository.

The fresh environment reaches the dependencies only through a .pth file naming this environment's
site-packages (no download); the repository's editable install is not seen there, since .pth files
inside a folder named by a .pth line are not processed.
"""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile

from helpers import TEST_CACHE_DIR, small_engine_args

from jaxserve.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = os.path.join(REPO, "tests", "fixtures", "default_model_expected.json")
MAX_TOKENS = 4


def _run(command: list[str], cwd: str, env: dict | None = None) -> str:
    """Run `command`, fail with its output when it fails, return its stdout."""
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _copy_sources(destination: str) -> None:
    """Copy the files a fresh clone would have (tracked, plus new files git does not ignore)."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO)
    for path in filter(None, listed.split("\0")):
        source = os.path.join(REPO, path)
        if not os.path.lexists(source):  # deleted in the working tree, not yet committed
            continue
        target = os.path.join(destination, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        else:
            with open(source, "rb") as src, open(target, "wb") as dst:
                dst.write(src.read())


def _fresh_venv(root: str) -> str:
    """A venv without pip whose only way to the dependencies is a .pth file; returns its python."""
    venv = os.path.join(root, "venv")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    python = os.path.join(venv, "bin", "python")
    site_packages = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site_packages, "dependencies.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    return python


def _clean_env() -> dict:
    """This process's environment without anything that would put the repository on the path."""
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}


def _session_shape_flags() -> list[str]:
    """Flags that give the test session's step shapes, so the shared compilation cache serves them.

    No --config: the bundled model's config file (configs/tiny-cpu.yaml, package data) is read as a
    user's `jaxserve generate` reads it, and these flags override its values.
    """
    options = small_engine_args()
    flags = []
    for name in ("max_model_len", "page_size", "num_pages", "max_num_seqs", "max_num_batched_tokens",
                 "min_token_bucket"):
        flags += [f"--{name.replace('_', '-')}", str(options[name])]
    return flags


def test_the_wheel_installed_in_a_fresh_venv_runs_generate(tmp_path):
    source, dist, elsewhere = tmp_path / "src", tmp_path / "dist", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _copy_sources(str(source))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(source)], cwd=str(tmp_path))
    (wheel,) = dist.glob("jaxserve-*.whl")
    assert "jaxserve/server/static/dashboard.html" in zipfile.ZipFile(wheel).namelist(), "the live page ships"
    python = _fresh_venv(str(tmp_path))
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", str(wheel)],
         cwd=str(tmp_path))
    env = _clean_env()
    where = _run([python, "-c", "import jaxserve; print(jaxserve.__file__)"], cwd=str(elsewhere), env=env).strip()
    assert where.startswith(str(tmp_path / "venv")), where

    with open(EXPECTED) as f:
        case = json.load(f)["cases"][0]
    jaxserve = os.path.join(os.path.dirname(python), "jaxserve")
    output = _run([jaxserve, "generate", "--prompt", case["prompt"], "--max-tokens", str(MAX_TOKENS),
                   "--temperature", "0", *_session_shape_flags(), "--compilation-cache-dir", TEST_CACHE_DIR],
                  cwd=str(elsewhere), env=env)
    tokenizer = load_tokenizer(os.path.join(REPO, "jaxserve", "assets", "tiny-stdlib-llama"))
    assert output == case["prompt"] + tokenizer.decode(case["output_token_ids"][:MAX_TOKENS]) + "\n"

