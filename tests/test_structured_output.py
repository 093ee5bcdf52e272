"""Structured output in the offline API (issue 18): on the bundled model, which knows nothing about JSON, every
constrained answer parses and validates against its schema, fully matches its regex, is one of its choices, or
is a sentence of its grammar, greedy and sampled, with many requests in flight; constraints compile once; bad
ones are a ValueError; nothing compiles after warm-up."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from helpers import small_engine_args
from jaxserve import LLM, SamplingParams
from jaxserve.structured.params import StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "string", "enum": ["S", "M", "L"]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "tags": {"type": "array", "items": {"type": "string",
                                                                                      "maxLength": 8},
                                                           "maxItems": 3}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["code", "ratio"], "additionalProperties": False},
]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'start: "(" NUM ("," NUM) ~ 0..3 ")"\nNUM: /[0-9]{1,3}/'  # bounded: a tiny model may never stop
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def llm():
    return LLM(None, **small_engine_args(max_model_len=256, max_num_seqs=16, enable_structured_outputs=True))


def _params(constraint: StructuredOutputsParams, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=160, temperature=temperature, seed=seed, structured_outputs=constraint)


def test_every_answer_meets_its_constraint(llm):
    cases = [(StructuredOutputsParams(json=schema), schema) for schema in SCHEMAS]
    cases += [(StructuredOutputsParams(regex=REGEX), None), (StructuredOutputsParams(choice=CHOICES), None),
              (StructuredOutputsParams(grammar=GRAMMAR), None)]
    params = [_params(c, t, seed) for c, _ in cases for t, seed in ((0.0, 0), (1.0, 1), (1.0, 2))]
    params.append(_params(StructuredOutputsParams(json_object=True), 0.0, 0))  # sampled, its keys may run on
    compiles_before = llm.engine.core.runner.num_lazy_compiles
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert llm.engine.core.runner.num_lazy_compiles == compiles_before, "constrained steps were warmed up"
    for param, output in zip(params, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (param.structured_outputs, completion.text)
        text, kind = completion.text, param.structured_outputs.kind
        if kind == "json":
            jsonschema.validate(json.loads(text), param.structured_outputs.json)
        elif kind == "json_object":
            assert isinstance(json.loads(text), dict)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES
        else:
            assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,3}\)", text), text
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_constrained_and_free_requests_share_steps(llm):
    """Free rows in a step with constrained ones keep their own tokens (every bit of their mask is set)."""
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPT] * 4, [free, _params(StructuredOutputsParams(choice=CHOICES), 0, 0)] * 2,
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == mixed[2].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text in CHOICES


def test_a_constraint_compiles_once(llm):
    compiler = llm.engine.grammars
    constraint = StructuredOutputsParams(json=SCHEMAS[0])
    first = compiler.compile(constraint)
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMAS[0]))) is first  # same schema as text


@pytest.mark.parametrize("fields,message", [
    ({"json": {"type": "strin"}}, "cannot compile the json constraint"),
    ({"regex": "(unclosed"}, "cannot compile the regex constraint"),
    ({"grammar": "start: undefined_rule"}, "cannot compile the grammar constraint"),
])
def test_a_constraint_that_cannot_compile_is_a_value_error(llm, fields, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.grammars.compile(StructuredOutputsParams(**fields))
    outputs = llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=fields), use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"  # the engine ends it alone and goes on
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


@pytest.mark.parametrize("fields", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"json": 3}, {"regex": 5}])
def test_malformed_constraints_are_refused(fields):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**fields)


def test_an_engine_with_structured_outputs_off_refuses_a_constraint_and_builds_fewer_samplers(llm):
    off = LLM(None, **small_engine_args(max_model_len=256, max_num_seqs=16))  # the tests' default: off
    with pytest.raises(ValueError, match="enable_structured_outputs off"):
        off.generate([PROMPT], _params(StructuredOutputsParams(choice=CHOICES), 0, 0), use_tqdm=False)
    samplers_on, samplers_off = llm.engine.core.runner.shapes()[1], off.engine.core.runner.shapes()[1]
    assert len(samplers_on) == 2 * len(samplers_off) and {shape[2] for shape in samplers_off} == {0}
