"""No single request can take the server down: every numeric field of every route at the int32 and
int64 limits, -1, 0, huge and tiny floats, NaN and infinity, sent one request at a time as raw JSON
text. Each answer is a 200 or a 400 with an OpenAI-shaped error body (never a 500 or 503), and
/health is 200 after each. The offline side: such values are a ValueError before anything is queued,
and the engine goes on serving.
"""

import json
import math

import httpx
import pytest
from conftest import API_KEY
from helpers import small_engine_args

from jaxserve import LLM, SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
NAN, INF = float("nan"), float("inf")
# json.dumps writes these as the literals NaN, Infinity and -Infinity, as a careless client would send them.
VALUES = [2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**31) - 1, -1, 0, 1e308, 1e-308, NAN, INF, -INF]
VALUE_IDS = ["i32max", "i32max+1", "i64max", "i64max+1", "i32min-1", "-1", "0", "1e308", "1e-308", "nan", "inf",
             "-inf"]

COMPLETION = {"model": "tiny-stdlib-llama", "prompt": "def f(x):", "max_tokens": 2}
CHAT = {"model": "tiny-stdlib-llama", "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 2}
# A length field set to a huge number is accepted and generates to the end of the model's context (128 tokens):
# such a case sends a prompt that leaves a few positions, so it decodes a few steps instead of a hundred.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")
NEAR_THE_LIMIT = {"prompt": "def f(x):" * 23, "messages": [{"role": "user", "content": "def f(x):" * 22}]}
SHARED_FIELDS = ["n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "prompt_logprobs", "min_tokens", "priority",
                 "truncate_prompt_tokens", "stop_token_ids[]", "logit_bias{}", "logit_bias[key]",
                 "allowed_token_ids[]"]
CASES = (
    [("/v1/completions", COMPLETION, field) for field in [*SHARED_FIELDS, "logprobs", "prompt[]", "prompt[[]]"]]
    + [("/v1/chat/completions", CHAT, field) for field in [*SHARED_FIELDS, "max_completion_tokens", "top_logprobs"]]
    + [("/tokenize", {"prompt": "def f(x):"}, field) for field in ["prompt", "add_special_tokens", "return_token_strs"]]
    + [("/tokenize", {"messages": CHAT["messages"]}, field)
       for field in ["add_generation_prompt", "continue_final_message"]]
    + [("/detokenize", {"tokens": [1]}, "tokens[]")]
)


def _with_value(base: dict, field: str, value) -> dict:
    """`base` with `field` set to `value`: `f[]` puts it in a list, `f[[]]` in a list of lists, `f{}` as the
    value of token 5 in a map, `f[key]` as a map key (JSON keys are strings)."""
    body = dict(base)
    if field in LENGTH_FIELDS:
        body.update({key: NEAR_THE_LIMIT[key] for key in body if key in NEAR_THE_LIMIT})
    if field.endswith("[[]]"):
        body[field[:-4]] = [[value]]
    elif field.endswith("[]"):
        body[field[:-2]] = [value]
    elif field.endswith("{}"):
        body[field[:-2]] = {"5": value}
    elif field.endswith("[key]"):
        body[field[:-5]] = {json.dumps(value): 1.0}
    else:
        body[field] = value
    if field == "top_logprobs":
        body["logprobs"] = True
    return body


@pytest.fixture(scope="module")
def http(openai_server):
    """One connection pool for the module's ~600 requests."""
    url, _ = openai_server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        yield client


def _name(field: str) -> str:
    """The request field a case sets."""
    return field.split("[")[0].split("{")[0]


def _assert_openai_error(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert "param" in error and "code" in error, error


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("path,base,field", CASES, ids=[f"{path}:{field}" for path, _, field in CASES])
def test_extreme_numbers_are_a_200_or_a_400_and_the_server_stays_healthy(http, path, base, field, value):
    body = _with_value(base, field, value)
    response = http.post(path, content=json.dumps(body))
    assert response.status_code in (200, 400), f"{body} -> {response.status_code} {response.text}"
    if not math.isfinite(value):  # no field takes NaN or infinity: refused, naming the field
        assert response.status_code == 400, response.text
        assert (response.json()["error"]["param"] or "").split(".")[0] == _name(field), response.text
    if response.status_code == 400:
        _assert_openai_error(response)
    elif path.startswith("/v1/"):
        assert response.json()["choices"], response.text
        if field in LENGTH_FIELDS:  # a huge length generates to the end of the context, after a prompt that fits
            usage = response.json()["usage"]
            assert usage["total_tokens"] == 128 and usage["completion_tokens"] >= 2, usage
    assert http.get("/health").status_code == 200, f"unhealthy after {body}"


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("field", ["top_k", "seed", "max_tokens", "logit_bias{}", "stop_token_ids[]"])
def test_extreme_numbers_in_a_stream_end_it_cleanly(http, field, value):
    """A streamed request is refused before its stream starts, or streams to `[DONE]` or an error event."""
    body = _with_value({**COMPLETION, "stream": True}, field, value)
    with http.stream("POST", "/v1/completions", content=json.dumps(body)) as response:
        assert response.status_code in (200, 400), f"{body} -> {response.status_code}"
        if response.status_code == 400:
            response.read()
            _assert_openai_error(response)
        else:
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" or "error" in json.loads(events[-1]), events[-3:]
    assert http.get("/health").status_code == 200, f"unhealthy after {body}"


# ---- offline -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(**small_engine_args())


GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.mark.parametrize("options", [
    dict(top_k=2**31), dict(n=2**31), dict(seed=2**63), dict(seed=-(2**63) - 1), dict(temperature=NAN),
    dict(temperature=INF), dict(top_p=NAN), dict(min_p=INF), dict(repetition_penalty=1e308 * 10),
    dict(presence_penalty=NAN), dict(stop_token_ids=[2**31]), dict(logit_bias={2**31: 1.0}),
    dict(logit_bias={5: NAN}), dict(allowed_token_ids=[-1]), dict(logprobs=2**31), dict(prompt_logprobs=-1),
    dict(max_tokens=-1), dict(min_tokens=2**63), dict(truncate_prompt_tokens=0),
], ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()))
def test_out_of_range_sampling_params_are_a_value_error_naming_the_field(options):
    with pytest.raises(ValueError, match=rf"^{next(iter(options))}"):
        SamplingParams(**options)


def test_a_refused_top_k_leaves_generate_working(llm):
    with pytest.raises(ValueError, match="^top_k"):
        llm.generate("def f(x):", SamplingParams(max_tokens=4, top_k=2**31))
    output = llm.generate("def f(x):", SamplingParams(max_tokens=4, top_k=2**31 - 1))[0].outputs[0]
    assert len(output.token_ids) == 4 and output.finish_reason == "length"


@pytest.mark.parametrize("options", [
    dict(stop_token_ids=[2**31 - 1]), dict(logit_bias={2**31 - 1: 1.0}), dict(allowed_token_ids=[10**9]),
], ids=lambda options: next(iter(options)))
def test_token_ids_outside_the_vocabulary_fail_at_generate_and_the_engine_goes_on(llm, options):
    before = llm.generate("def f(x):", GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=next(iter(options))):
        llm.generate("def f(x):", SamplingParams(max_tokens=4, **options))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("def f(x):", GREEDY)[0].outputs[0].token_ids == before
