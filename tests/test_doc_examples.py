"""The documentation's Python examples run as written (issue 50): docs/python-api.md's in order in one process, from the
clone's root, as a reader runs them, and the README's, whose first is python-api.md's first (its server examples run
against a server in test_first_hour_messages.py). The one example that needs a folder of the reader's own (a
`path/to/...` placeholder in its code) is skipped by name."""

import json
import os
import subprocess
import sys
import tempfile

import pytest
from helpers import FAST_COMPILE_XLA_FLAG, markdown_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_API = os.path.join(ROOT, "docs", "python-api.md")
README = os.path.join(ROOT, "README.md")
NEEDS_A_FOLDER = {"Sequence classifiers": "an XForSequenceClassification folder"}  # skipped, by section
# LLM() compiles into ~/.cache/jaxserve: a HOME kept between runs keeps that cache warm without touching the user's
EXAMPLES_HOME = os.path.join(tempfile.gettempdir(), "jaxserve-test-doc-examples-home")
MARKER = "=== example: "


def python_blocks(path: str) -> list[tuple[str, str]]:
    """(the heading above it, its code) for each ```python block of a Markdown file, in order."""
    return markdown_blocks(path, "python")


def needs_a_folder(code: str) -> bool:
    """Whether the code (not its comments) names a placeholder path."""
    return any("path/to/" in line.split("#")[0] for line in code.splitlines())


def test_only_the_named_examples_need_a_folder_of_your_own():
    assert {name for name, code in python_blocks(PYTHON_API) if needs_a_folder(code)} == set(NEEDS_A_FOLDER)
    assert not [name for name, code in python_blocks(README) if needs_a_folder(code)]


def test_the_readme_python_example_is_the_python_api_first():
    (_, readme_first), *_ = python_blocks(README)
    assert readme_first == python_blocks(PYTHON_API)[0][1]  # so the run below runs it


@pytest.fixture(scope="module")
def example_outputs() -> dict[str, str]:
    """Every runnable python-api.md example run in order in one fresh process: its stdout, by section."""
    script = "".join(f"print({MARKER + name!r}, flush=True)\n{code}" for name, code in python_blocks(PYTHON_API)
                     if name not in NEEDS_A_FOLDER)
    env = {**os.environ, "HOME": EXAMPLES_HOME, "XLA_FLAGS": FAST_COMPILE_XLA_FLAG, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    sections = result.stdout.split(MARKER)[1:]
    return {section.split("\n", 1)[0]: section.split("\n", 1)[1] for section in sections}


def test_every_runnable_example_ran(example_outputs):
    assert list(example_outputs) == [name for name, _ in python_blocks(PYTHON_API) if name not in NEEDS_A_FOLDER]


def test_the_examples_print_what_their_comments_say(example_outputs):
    assert example_outputs["Generate and chat"].rstrip().endswith("}")  # the stats dict
    beam_text = example_outputs["Beam search"]
    assert beam_text.startswith("def parse(") and "<s>" not in beam_text  # the prompt, without special tokens
    assert "name" in json.loads(example_outputs["Structured output"].splitlines()[0])
    assert example_outputs["LoRA adapters"].strip()
    assert example_outputs["New weights without a restart"].strip() == "1"
    assert example_outputs["Scoring a prompt"].startswith("[{")
