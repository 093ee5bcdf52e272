"""The small model that ships with jaxserve: it loads with no arguments and matches Hugging Face."""

import json
import os

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import DEFAULT_MODEL_CONFIG, EngineConfig
from jaxserve.engine.llm_engine import default_model_path

EXPECTED = os.path.join(os.path.dirname(__file__), "fixtures", "default_model_expected.json")


@pytest.fixture(scope="module")
def llm():
    return LLM(show_progress=False, skip_precompile=True)


def test_no_model_means_the_bundled_model_with_the_tiny_cpu_config():
    config = EngineConfig.for_model(None, max_num_seqs=4)
    assert config == EngineConfig.from_yaml(DEFAULT_MODEL_CONFIG, max_num_seqs=4)
    assert config.model_config.model is None and config.scheduler_config.max_num_seqs == 4


def test_bundled_model_is_a_small_hugging_face_folder():
    folder = default_model_path()
    names = set(os.listdir(folder))
    for required in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"):
        assert required in names
    size = sum(os.path.getsize(os.path.join(folder, name)) for name in names)
    assert size <= 10 * 2**20
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


def test_greedy_tokens_equal_hugging_face(llm):
    with open(EXPECTED) as f:
        cases = json.load(f)["cases"]
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=len(cases[0]["output_token_ids"]), ignore_eos=True)
    outputs = llm.generate([case["prompt"] for case in cases], params, use_tqdm=False)
    for case, output in zip(cases, outputs):
        assert tokenizer.encode(case["prompt"]) == case["prompt_token_ids"]
        assert output.prompt_token_ids == case["prompt_token_ids"]
        assert output.outputs[0].token_ids == case["output_token_ids"]


def test_chat_template_renders_and_generates(llm):
    (result,) = llm.chat([{"role": "user", "content": "def add(a, b):"}], SamplingParams(max_tokens=8, seed=0))
    assert result.outputs[0].token_ids and result.finished
