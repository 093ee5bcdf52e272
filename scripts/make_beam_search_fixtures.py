"""Record Hugging Face transformers' beam search, the reference for `LLM.beam_search`.

Needs torch and transformers (not needed by CI). From the repository root:
    python scripts/make_beam_search_fixtures.py
Writes tests/fixtures/checkpoints/<name>/expected_beam_search.json for llama and qwen2: for the
prompts of that folder's expected.json and a few seeded random prompts on which a beam finishes on
EOS, beam widths 2 and 4 and 8 new tokens, the W sequences
`generate(num_beams=W, num_return_sequences=W, do_sample=False)` returns (generated tokens, best first,
cut after the EOS that finished a beam) with their cumulative logprobs.

HF's beam search and vLLM's (jaxserve's) agree only under some settings; each case runs under one of:
  - "ignore_eos": HF with no EOS token (eos_token_id=None), jaxserve with ignore_eos=True. Nothing
    finishes before max_new_tokens, every returned beam has the same length, so both rank the final
    beams by cumulative logprob whatever the length penalty (1.0 here).
  - "eos": EOS (id 1) reachable, length_penalty=0.0 (rank by cumulative logprob) and HF's default
    early_stopping=False, which with length_penalty=0 stops only once no running beam can beat the
    finished ones: the same result as running to max_new_tokens.
Elsewhere they differ: vLLM normalises by the whole length (prompt included, EOS excluded), HF by the
generated length (EOS included); HF lets a beam finish only when its EOS candidate is among the W best
of the step, vLLM finishes every EOS candidate of every beam's top 2W; early_stopping=True stops at W
finished beams. Before writing, the script runs jaxserve's own search (jaxserve.engine.beam_search, fed by the
HF model) on every case and refuses to write a case where the two disagree; it also reports how often
they disagree under settings outside the two above. `min_margin` is the smallest gap between a kept and
a dropped candidate (or between ranked results) over the search, so a test can see how far each case
is from a float32 tie.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxserve.engine.beam_search import BeamSearch, BeamSearchParams, beam_search_score  # noqa: E402
from jaxserve.request import Logprob  # noqa: E402

CHECKPOINTS = ROOT / "tests" / "fixtures" / "checkpoints"
CHECKPOINT_NAMES = ("llama", "qwen2")
NUM_PROMPTS = 12  # all of expected.json's prompts: 1 to 70 tokens
# Plus random prompts (seeded) on which a returned beam finishes on EOS, so EOS handling is covered too.
NUM_EOS_PROMPTS, EOS_PROMPT_SEED, MAX_DRAWS = 6, 2024, 400
BEAM_WIDTHS = (2, 4)
MAX_NEW_TOKENS = 8
EOS_ID, PAD_ID = 1, 3
# name -> (jaxserve's ignore_eos, length_penalty, HF's eos_token_id)
SETTINGS = {"ignore_eos": (True, 1.0, None), "eos": (False, 0.0, EOS_ID)}
# Settings outside SETTINGS, only counted: length penalties that make the two length rules differ.
DISAGREEING_SETTINGS = {"eos_length_penalty_1": (False, 1.0, EOS_ID), "eos_length_penalty_2": (False, 2.0, EOS_ID)}
MIN_MARGIN = 1e-4  # cases closer than this to a tie are left out


def load_model(path: Path) -> torch.nn.Module:
    """The HF causal LM at `path`, float32, eager attention, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, attn_implementation="eager", dtype=torch.float32
    ).eval()


def hf_beam_search(model, prompt: list[int], width: int, setting: tuple) -> list[tuple[list[int], float]]:
    """HF's W sequences for one prompt, best first: (generated tokens up to and including a finishing EOS,
    cumulative logprob recovered from the length-normalised score)."""
    _, length_penalty, eos = setting
    config = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=MAX_NEW_TOKENS, length_penalty=length_penalty, early_stopping=False,
                              eos_token_id=eos, pad_token_id=PAD_ID, bos_token_id=0, return_dict_in_generate=True,
                              output_scores=True)
    model.generation_config.eos_token_id = eos  # generate fills a None eos_token_id from the model's config
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    results = []
    for sequence, score in zip(out.sequences, out.sequences_scores.tolist()):
        generated = sequence[len(prompt):].tolist()
        if eos is not None and eos in generated:
            generated = generated[:generated.index(eos) + 1]
        results.append((generated, score * len(generated) ** length_penalty))
    return results


def next_token_candidates(model, tokens: list[int], count: int) -> dict[int, Logprob]:
    """What a jaxserve step returns for a beam: the `count` most likely next tokens and their logprobs."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].to(torch.float32)  # (V,)
    values, ids = torch.topk(torch.log_softmax(logits, dim=-1), count)  # (count,) each
    return {int(t): Logprob(float(v), rank=r + 1) for r, (t, v) in enumerate(zip(ids.tolist(), values.tolist()))}


def jaxserve_search(model, tokenizer, prompt: list[int], width: int, setting: tuple) -> tuple[list, float, bool]:
    """jaxserve's algorithm fed by the HF model: (W results as hf_beam_search gives them, min margin, whether
    some step finished a beam on an EOS candidate outside that step's W best candidates: HF would not)."""
    ignore_eos, length_penalty, _ = setting
    params = BeamSearchParams(width, MAX_NEW_TOKENS, ignore_eos=ignore_eos, length_penalty=length_penalty)
    search = BeamSearch(prompt, params, (EOS_ID,), max_model_len=10**6)
    margin, late_eos = float("inf"), False
    while not search.done:
        candidates = [next_token_candidates(model, beam.tokens, 2 * width) for beam in search.live]
        margin = min(margin, _selection_margin(search, candidates))
        late_eos = late_eos or _eos_outside_best(search, candidates)
        search.advance(candidates)
    margin = min(margin, _ranking_margin(search))
    output = search.output(tokenizer)
    return [(beam.tokens[len(prompt):], beam.cum_logprob) for beam in output.sequences], margin, late_eos


def _eos_outside_best(search: BeamSearch, candidates: list[dict[int, Logprob]]) -> bool:
    """True when an EOS candidate of this step ranks below the step's W best candidates (EOS or not)."""
    ranked = sorted(((beam.cum_logprob + entry.logprob, token_id) for beam, entries in zip(search.live, candidates)
                     for token_id, entry in entries.items()), reverse=True)
    return any(token_id in search.eos_token_ids for _, token_id in ranked[search.params.beam_width:])


def _selection_margin(search: BeamSearch, candidates: list[dict[int, Logprob]]) -> float:
    """Gap between the last kept and the first dropped live candidate of one step."""
    cums = sorted((beam.cum_logprob + entry.logprob for beam, entries in zip(search.live, candidates)
                   for token_id, entry in entries.items() if token_id not in search.eos_token_ids), reverse=True)
    width = search.params.beam_width
    return cums[width - 1] - cums[width] if len(cums) > width else float("inf")


def _ranking_margin(search: BeamSearch) -> float:
    """Smallest gap between consecutive final scores among the best W + 1 beams."""
    beams = search.finished + [dataclasses.replace(beam, finish_reason="length") for beam in search.live]
    scores = sorted((beam_search_score(beam, search.params.length_penalty) for beam in beams),
                    reverse=True)[:search.params.beam_width + 1]
    return min((a - b for a, b in zip(scores, scores[1:])), default=float("inf"))


def agree(hf: list, ours: list) -> bool:
    """Same sequences in the same order, cumulative logprobs within float32 noise."""
    return ([t for t, _ in hf] == [t for t, _ in ours]
            and all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(hf, ours)))


def checkpoint_cases(name: str) -> tuple[list[dict], dict[str, str]]:
    """The agreeing cases of one checkpoint, and a count of agreement per setting (kept ones and others)."""
    folder = CHECKPOINTS / name
    model, tokenizer = load_model(folder), AutoTokenizer.from_pretrained(folder, local_files_only=True)
    prompts = json.loads((folder / "expected.json").read_text())["prompts"][:NUM_PROMPTS]
    prompts += eos_prompts(model, tokenizer)
    cases, tally = [], {}
    for setting_name, setting in {**SETTINGS, **DISAGREEING_SETTINGS}.items():
        agreeing = total = late = 0
        for width in BEAM_WIDTHS:
            for prompt in prompts:
                hf = hf_beam_search(model, prompt, width, setting)
                ours, margin, late_eos = jaxserve_search(model, tokenizer, prompt, width, setting)
                total += 1
                agreeing += agree(hf, ours)
                late += late_eos
                if setting_name in SETTINGS and margin >= MIN_MARGIN and not late_eos:
                    assert agree(hf, ours), (name, setting_name, width, prompt, hf, ours)
                    cases.append(_case(prompt, width, setting_name, setting, hf, margin))
        tally[setting_name] = f"{agreeing}/{total} agree; {late} with an EOS candidate outside a step's W best"
    return cases, tally


def eos_prompts(model, tokenizer) -> list[list[int]]:
    """Seeded random prompts (2 to 40 ordinary tokens) on which, with beam width 4 under the "eos"
    setting, a returned beam finishes on EOS and HF's rule for finishing agrees with vLLM's."""
    rng = random.Random(EOS_PROMPT_SEED)
    found = []
    for _ in range(MAX_DRAWS):
        prompt = [rng.randrange(PAD_ID + 1, model.config.vocab_size) for _ in range(rng.randint(2, 40))]
        ours, _, late_eos = jaxserve_search(model, tokenizer, prompt, 4, SETTINGS["eos"])
        if not late_eos and any(tokens[-1] == EOS_ID for tokens, _ in ours):
            found.append(prompt)
            if len(found) == NUM_EOS_PROMPTS:
                break
    return found


def _case(prompt: list[int], width: int, setting_name: str, setting: tuple, hf: list, margin: float) -> dict:
    ignore_eos, length_penalty, eos = setting
    return {"setting": setting_name, "prompt_token_ids": prompt, "beam_width": width, "max_tokens": MAX_NEW_TOKENS,
            "ignore_eos": ignore_eos, "length_penalty": length_penalty, "hf_eos_token_id": eos,
            "hf_early_stopping": False, "sequences": [tokens for tokens, _ in hf],
            "cum_logprobs": [cum for _, cum in hf], "min_margin": margin}


def to_json(fixture: dict) -> str:
    """`fixture` as JSON with one line per case."""
    cases = ",\n  ".join(json.dumps(case) for case in fixture["cases"])
    rest = "".join(f",\n {json.dumps(k)}: {json.dumps(v)}" for k, v in fixture.items() if k != "cases")
    return "{\n \"cases\": [\n  " + cases + "\n ]" + rest + "\n}"


def main() -> None:
    """Write one fixture per checkpoint and print how often each setting agrees."""
    torch.set_num_threads(1)
    for name in CHECKPOINT_NAMES:
        cases, tally = checkpoint_cases(name)
        fixture = {"cases": cases, "agreement": tally, "torch_version": torch.__version__,
                   "transformers_version": transformers.__version__, "python_version": platform.python_version()}
        path = CHECKPOINTS / name / "expected_beam_search.json"
        path.write_text(to_json(fixture) + "\n")
        eos_cases = sum(any(EOS_ID in s for s in c["sequences"]) for c in cases if c["setting"] == "eos")
        print(f"wrote {path}: {len(cases)} cases ({eos_cases} with a beam finished on EOS); {tally}")


if __name__ == "__main__":
    main()
