"""Beam search: LLM.beam_search equals Hugging Face's beam search token for token on the test
checkpoints (fixtures made by scripts/make_beam_search_fixtures.py, which explains the settings under
which the two algorithms agree); the pure beam step and the length-penalised ranking; parameter and
prompt checks; use_beam_search on /v1/completions equals LLM.beam_search on the same model."""

import json
import math
import os

import httpx
import pytest
from conftest import API_KEY
from helpers import checkpoint, expected, http_client, small_engine_args

from jaxserve import LLM, BeamSearchParams
from jaxserve.engine.beam_search import BeamSearch, BeamSearchSequence, beam_search_score, beam_step
from jaxserve.request import Logprob

EOS = 1  # the fixture checkpoints' EOS id

# ---- against Hugging Face ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_case(request):
    """An LLM on a fixture checkpoint and its recorded HF beam searches."""
    with open(os.path.join(checkpoint(request.param), "expected_beam_search.json")) as f:
        cases = json.load(f)["cases"]
    return LLM(checkpoint(request.param), **small_engine_args(skip_precompile=False)), cases, request.param


def _groups(cases: list[dict]) -> dict[tuple, list[dict]]:
    """Cases by (beam width, ignore_eos, length penalty, max tokens): one beam_search call each."""
    groups = {}
    for case in cases:
        key = (case["beam_width"], case["ignore_eos"], case["length_penalty"], case["max_tokens"])
        groups.setdefault(key, []).append(case)
    return groups


def test_beam_search_matches_hugging_face(hf_case):
    llm, cases, _ = hf_case
    assert {c["setting"] for c in cases} == {"ignore_eos", "eos"}
    assert any(seq[-1] == EOS for c in cases for seq in c["sequences"]), "the fixture covers beams ending on EOS"
    for (width, ignore_eos, length_penalty, max_tokens), group in _groups(cases).items():
        params = BeamSearchParams(width, max_tokens, ignore_eos=ignore_eos, length_penalty=length_penalty)
        outputs = llm.beam_search([{"prompt_token_ids": c["prompt_token_ids"]} for c in group], params)
        for case, output in zip(group, outputs):
            prompt = case["prompt_token_ids"]
            assert output.prompt_token_ids == prompt
            assert [s.tokens[len(prompt):] for s in output.sequences] == case["sequences"], case
            assert [s.tokens[:len(prompt)] for s in output.sequences] == [prompt] * width
            for sequence, cum_logprob in zip(output.sequences, case["cum_logprobs"]):
                assert sequence.cum_logprob == pytest.approx(cum_logprob, abs=1e-3)
                assert len(sequence.logprobs) == len(sequence.tokens) - len(prompt)
                on_eos = not ignore_eos and sequence.tokens[-1] == EOS
                assert (sequence.finish_reason, sequence.stop_reason) == (("stop", EOS) if on_eos else ("length", None))
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["compilations_after_warmup"] == 0


def test_beam_width_one_is_greedy(hf_case):
    llm, _, name = hf_case
    want = expected(name)
    params = BeamSearchParams(1, 8, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in want["prompts"]], params)
    for prompt, greedy, output in zip(want["prompts"], want["outputs"], outputs):
        (sequence,) = output.sequences
        assert sequence.tokens == prompt + greedy[:8]


# ---- the algorithm ------------------------------------------------------------------------------------


def _entries(*pairs: tuple[int, float]) -> dict[int, Logprob]:
    return {token_id: Logprob(logprob, rank=rank) for rank, (token_id, logprob) in enumerate(pairs, 1)}


def test_beam_step_keeps_the_best_cumulative_candidates_and_finishes_eos():
    beams = [BeamSearchSequence([7, 8], [], cum_logprob=-1.0), BeamSearchSequence([7, 9], [], cum_logprob=-2.0)]
    candidates = [_entries((EOS, -0.1), (5, -0.5), (6, -3.0)), _entries((4, -0.2), (EOS, -0.4), (3, -0.3))]
    live, finished = beam_step(beams, candidates, beam_width=2, eos_token_ids=(EOS,))
    assert [(b.tokens, b.cum_logprob) for b in live] == [([7, 8, 5], -1.5), ([7, 9, 4], -2.2)]
    assert live[0].logprobs == [candidates[0]] and live[1].logprobs == [candidates[1]]
    assert [(b.tokens, b.cum_logprob, b.finish_reason, b.stop_reason) for b in finished] == [
        ([7, 8, EOS], pytest.approx(-1.1), "stop", EOS), ([7, 9, EOS], pytest.approx(-2.4), "stop", EOS)]
    live, finished = beam_step(beams, candidates, beam_width=3, eos_token_ids=())  # ignore_eos: EOS is a token
    assert [b.tokens[-1] for b in live] == [EOS, 5, 4] and finished == []
    assert beams[0].tokens == [7, 8], "the parent beams are left as they were"


def test_score_divides_by_the_whole_length_without_the_finishing_eos():
    live = BeamSearchSequence([1, 2, 3, EOS], [], cum_logprob=-6.0, finish_reason="length")
    stopped = BeamSearchSequence([1, 2, 3, EOS], [], cum_logprob=-6.0, finish_reason="stop")
    assert beam_search_score(live, 1.0) == -1.5 and beam_search_score(stopped, 1.0) == -2.0
    assert beam_search_score(stopped, 0.0) == -6.0 and beam_search_score(stopped, 2.0) == pytest.approx(-6.0 / 9)


def test_output_ranks_finished_and_live_beams_by_length_penalised_score():
    class Tokenizer:
        def decode(self, tokens, skip_special_tokens=False):
            return " ".join(str(t) for t in tokens if not (skip_special_tokens and t == EOS))

    def search(length_penalty):
        s = BeamSearch([10, 11], BeamSearchParams(2, 4, length_penalty=length_penalty), (EOS,), max_model_len=64)
        s.advance([_entries((EOS, -1.0), (5, -0.9), (6, -1.2))])
        s.advance([_entries((7, -0.6), (8, -2.0)), _entries((9, -0.5), (4, -3.0))])
        return s.output(Tokenizer())

    by_cum = search(0.0).sequences  # finished [10, 11, EOS] at -1.0 against live at -1.5 and -1.7
    assert [(s.tokens, s.finish_reason) for s in by_cum] == [([10, 11, EOS], "stop"), ([10, 11, 5, 7], "length")]
    assert by_cum[0].text == "10 11"  # the EOS is a special token: not in the text
    long_favoured = search(3.0).sequences  # -1.5 / 4**3 and -1.7 / 4**3 beat -1.0 / 2**3 (EOS not counted)
    assert [s.tokens for s in long_favoured] == [[10, 11, 5, 7], [10, 11, 6, 9]]


def test_search_never_outgrows_max_model_len():
    search = BeamSearch(list(range(10, 30)), BeamSearchParams(2, 50), (EOS,), max_model_len=23)
    assert search.steps_left == 3
    with pytest.raises(ValueError, match="max_model_len"):
        BeamSearch(list(range(10, 33)), BeamSearchParams(2, 5), (EOS,), max_model_len=23)


@pytest.mark.parametrize("field,value", [
    ("beam_width", 0), ("beam_width", 11), ("beam_width", 2.0), ("beam_width", True), ("max_tokens", 0),
    ("max_tokens", None), ("ignore_eos", 1), ("temperature", -0.5), ("temperature", math.inf),
    ("length_penalty", math.nan), ("length_penalty", "1"),
])
def test_params_are_validated_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, field: value})


def test_step_params_ask_for_two_candidates_per_beam():
    step = BeamSearchParams(3, 9, temperature=0.5).step_params()
    assert (step.max_tokens, step.logprobs, step.temperature, step.n) == (1, 6, 0.5, 1)


# ---- the offline API on the bundled model ------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    """The bundled model with the settings of the test server."""
    return LLM(**small_engine_args())


def test_prompt_forms_text_and_bad_prompts(llm):
    text = "def add(a, b):\n    return"
    tokens = llm.get_tokenizer().encode(text)
    params = BeamSearchParams(2, 5)
    by_text, by_ids, by_dict = llm.beam_search([text, tokens, {"prompt_token_ids": tokens, "cache_salt": "s"}], params)
    assert by_text.prompt == text and by_ids.prompt is None and by_text.prompt_token_ids == tokens
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences] == \
        [s.tokens for s in by_dict.sequences]
    best = by_text.sequences[0]
    assert best.text == llm.get_tokenizer().decode(best.tokens, skip_special_tokens=True)
    assert best.tokens[0] == llm.get_tokenizer().bos_token_id and best.text.startswith(text)  # no "<s>" in front
    assert best.cum_logprob == pytest.approx(sum(entries[t].logprob for t, entries in
                                                 zip(best.tokens[len(tokens):], best.logprobs)))
    for bad in ([""], [[10**6]], [[]], [{"prompt": text}, "x" * 0]):
        with pytest.raises(ValueError):
            llm.beam_search(bad, params)
    stats = llm.stats()
    assert stats["num_requests_waiting"] == stats["num_requests_running"] == 0
    assert llm.beam_search([], params) == []


# ---- use_beam_search on /v1/completions ------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["def fibonacci(n):\n    return", "import os\n"]


def _complete(url: str, body: dict) -> httpx.Response:
    """POST /v1/completions with use_beam_search (unless `body` says otherwise); Python's JSON, so
    non-finite floats go through as Infinity / NaN."""
    return http_client.post(f"{url}/v1/completions", content=json.dumps({"use_beam_search": True, **body}),
                            headers={**AUTH, "Content-Type": "application/json"}, timeout=120)


def _assert_error(response: httpx.Response, param: str, words: str = "") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error["message"]


def _offline_choices(llm: LLM, prompts: list, params: BeamSearchParams, n: int) -> list[dict]:
    """What the server should answer: the n best beams of each prompt, generated tokens without the
    finishing EOS, their text without special tokens."""
    tokenizer = llm.get_tokenizer()
    choices = []
    for output in llm.beam_search(prompts, params):
        for beam in output.sequences[:n]:
            end = len(beam.tokens) - (beam.finish_reason == "stop")
            generated = beam.tokens[len(output.prompt_token_ids):end]
            choices.append({"token_ids": generated, "text": tokenizer.decode(generated, skip_special_tokens=True),
                            "finish_reason": beam.finish_reason})
    return choices


@pytest.mark.parametrize("request_fields,width", [
    ({"n": 2, "max_tokens": 8}, 2),
    ({"n": 2, "best_of": 4, "max_tokens": 6, "length_penalty": 0.5}, 4),
    ({"n": 3, "max_tokens": 6, "ignore_eos": True, "length_penalty": 2.0}, 3),
])
def test_server_beam_search_equals_offline(openai_server, llm, request_fields, width):
    url, _ = openai_server
    response = _complete(url, {"prompt": PROMPTS, "return_token_ids": True, **request_fields})
    assert response.status_code == 200, response.text
    body = response.json()
    n = request_fields["n"]
    params = BeamSearchParams(width, request_fields["max_tokens"], ignore_eos=request_fields.get("ignore_eos", False),
                              length_penalty=request_fields.get("length_penalty", 1.0))
    want = _offline_choices(llm, PROMPTS, params, n)
    got = [{k: c[k] for k in ("token_ids", "text", "finish_reason")} for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == list(range(len(PROMPTS) * n))
    assert got == want
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [ids for ids in prompt_ids for _ in range(n)]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompt_ids))
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in got)


def test_server_beam_search_logprobs_come_from_the_candidates(openai_server, llm):
    url, _ = openai_server
    response = _complete(url, {"prompt": PROMPTS[0], "n": 2, "max_tokens": 4, "logprobs": 3, "ignore_eos": True})
    assert response.status_code == 200, response.text
    (output,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(2, 4, ignore_eos=True))
    for choice, beam in zip(response.json()["choices"], output.sequences):
        logprobs = choice["logprobs"]
        generated = beam.tokens[len(output.prompt_token_ids):]
        want = [entries[t].logprob for t, entries in zip(generated, beam.logprobs)]
        assert logprobs["token_logprobs"] == pytest.approx(want, abs=1e-5)
        assert all(1 <= len(top) <= 4 for top in logprobs["top_logprobs"])


@pytest.mark.parametrize("fields,param,words", [
    ({"stream": True}, "stream", "streaming"),
    ({"top_p": 0.5}, "top_p", "use_beam_search"),
    ({"stop": ["\n"]}, "stop", "use_beam_search"),
    ({"echo": True}, "echo", "use_beam_search"),
    ({"n": 2, "logprobs": 5}, "logprobs", "at most 4"),
    ({"n": 2, "best_of": 1}, "best_of", ""),
    ({"length_penalty": math.inf}, "length_penalty", "finite"),
    ({"prompt": [10**6]}, "prompt", ""),
    ({"early_stopping": True}, "early_stopping", "not supported"),
])
def test_server_beam_search_refuses_what_it_cannot_honour(openai_server, fields, param, words):
    url, _ = openai_server
    _assert_error(_complete(url, {"prompt": PROMPTS[0], "max_tokens": 4, **fields}), param, words)


def test_server_neutral_values_are_accepted_and_plain_requests_ignore_length_penalty(openai_server):
    url, _ = openai_server
    neutral = {"top_p": 1.0, "top_k": -1, "stop": [], "echo": False, "early_stopping": False, "temperature": 0}
    assert _complete(url, {"prompt": PROMPTS[0], "max_tokens": 2, **neutral}).status_code == 200
    plain = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "use_beam_search": False}
    a = _complete(url, plain).json()["choices"][0]["text"]
    b = _complete(url, {**plain, "length_penalty": 0.3}).json()["choices"][0]["text"]
    assert a == b
