"""orbax checkpoints of the engine's params (issue 16): `jaxserve convert`, and a converted folder as a model.

A converted folder must give the Hugging Face folder's greedy tokens (float, and int8 against int8 made at
load time), load under tensor parallelism 2 reading each shard once, and refuse what it cannot be: another quantization
or dtype than it holds, a tensor parallelism its stored KV heads do not fit, a config.json edited after converting, a
destination that is not empty.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import checkpoint, expected, pythonpath_without_torch, small_engine_args

from jaxserve import LLM, SamplingParams
from jaxserve.cli import main
from jaxserve.model.checkpoint import MARKER, convert, read_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = small_engine_args(max_num_seqs=4, max_num_batched_tokens=32, num_pages=48, skip_precompile=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in expected("llama")["prompts"][:6]]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, str]:
    """The llama test checkpoint converted as it is (through the command line) and with int8 weights."""
    folders = {"float": str(tmp_path_factory.mktemp("float") / "llama"),
               "int8": str(tmp_path_factory.mktemp("int8") / "llama")}
    assert main(["convert", checkpoint("llama"), folders["float"]]) == 0
    convert(checkpoint("llama"), folders["int8"], quantization="int8")
    return folders


def test_a_converted_folder_is_self_contained(converted):
    files = set(os.listdir(converted["float"]))
    assert {MARKER, "params", "config.json", "tokenizer.json", "generation_config.json"} <= files
    assert not any(name.endswith(".safetensors") for name in files)
    assert read_metadata(converted["int8"])["quantization"] == "int8"
    assert read_metadata(converted["float"])["dtype"] == "float32"


def test_converted_weights_give_the_hugging_face_folders_tokens(converted):
    assert _tokens(LLM(converted["float"], **ARGS)) == _tokens(LLM(checkpoint("llama"), **ARGS))
    int8 = _tokens(LLM(converted["int8"], **ARGS))
    assert int8 == _tokens(LLM(checkpoint("llama"), quantization="int8", **ARGS))
    assert _tokens(LLM(converted["int8"], tensor_parallel_size=2, **ARGS)) == int8


def test_a_converted_folder_refuses_what_it_does_not_hold(converted, tmp_path):
    with pytest.raises(ValueError, match="holds int8 weights but quantization=fp8"):
        LLM(converted["int8"], quantization="fp8", **ARGS)
    with pytest.raises(ValueError, match="holds float32 weights but dtype=bfloat16"):
        LLM(converted["float"], dtype="bfloat16", **ARGS)
    single_kv_head = str(tmp_path / "qwen2")
    convert(checkpoint("qwen2"), single_kv_head)  # 1 KV head: TP 2 replicates it to 2
    with pytest.raises(ValueError, match="convert with --tensor-parallel-size 2"):
        LLM(single_kv_head, tensor_parallel_size=2, **ARGS)
    with pytest.raises(ValueError, match="is not empty"):
        convert(checkpoint("llama"), converted["float"])


@pytest.mark.parametrize("kind", ["float", "int8"])
def test_a_config_edited_after_converting_is_refused_like_a_hugging_face_folders(converted, kind, tmp_path):
    edited = {}
    for name, source in [("converted", converted[kind]), ("hugging face", checkpoint("llama"))]:
        folder = edited[name] = str(tmp_path / name.replace(" ", "-"))
        shutil.copytree(source, folder)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config["intermediate_size"] += 64
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    with pytest.raises(ValueError, match="does not fit the served model"):
        LLM(edited["hugging face"], **ARGS)
    with pytest.raises(ValueError, match=r"stores the weight 'model.layers.{i}.mlp.gate_proj.weight' in shape "
                                         r"\(2, 64, 128\) but its config.json gives the model \(2, 64, 192\)"):
        LLM(edited["converted"], **ARGS)


READS_SCRIPT = """
import json, sys
import jax
from jaxserve.model.checkpoint import load_checkpoint
from jaxserve.sharding import cache_kv_heads, make_mesh
from jaxserve.model_spec import ModelSpec
from jaxserve.model.registry import load_model_spec


def bytes_read():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


folder = sys.argv[1]
spec = load_model_spec(folder)
read = {1: [], 2: []}
for tp in (1, 2) + (1, 2) * 3:
    before = bytes_read()
    jax.block_until_ready(load_checkpoint(folder, spec, make_mesh(tp), cache_kv_heads(spec, tp), "auto", "none"))
    read[tp].append(bytes_read() - before)
print(json.dumps({tp: min(counts[1:]) for tp, counts in read.items()}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's per-process I/O accounting")
def test_each_shard_is_read_once_under_tensor_parallelism(converted):
    """Restoring at TP 2 reads the checkpoint's files once, as TP 1 does: each device reads its own shard of a
    split array, and a replicated array is read once, not once per device (up to small repeated reads). Measured in a
    process of its own (two CPU devices, no compilation cache, nothing else reading), after a first load of each that
    compiles, the least of three loads."""
    folder = converted["float"]
    files = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(os.path.join(folder, "params"))
                for name in names)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": pythonpath_without_torch(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", READS_SCRIPT, folder], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    read = {int(tp): count for tp, count in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    # Reading a split array whole on each device would add most of the files again (the layers and the LM head
    # are split: ~80% of this checkpoint). TP 2 was seen reading up to ~11% more than the files on a busy machine
    # (orbax and tensorstore reading some metadata or chunks twice), never close to that.
    assert read[1] <= 1.1 * files and read[2] <= 1.4 * files, (read, files)
