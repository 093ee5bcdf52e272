#!/usr/bin/env python
"""Generate a tiny random EAGLE-1 draft head for the ``llama`` test checkpoint, plus its torch proposals.

The head is a test fixture for jaxserve's EAGLE proposer (the format vLLM's ``method: "eagle"`` reads, as
yuhuili/EAGLE-LLaMA3-Instruct-8B). CI has no torch, so the reference proposals are computed here once and stored
next to the head. Run from the repository root::

    python scripts/make_eagle_fixture.py

This (re)writes ``tests/fixtures/checkpoints/llama-eagle/`` (deleting it first) with:

* ``config.json``: the target's config.json (``tests/fixtures/checkpoints/llama``) with ``num_hidden_layers: 1``.
* ``model.safetensors`` (float32), names without a ``model.`` prefix: ``fc.weight`` (H, 2H), ``fc.bias`` (H,) and
  one Llama decoder layer ``layers.0.*`` without ``input_layernorm`` (EAGLE-1's first layer has none); no final
  norm, no ``embed_tokens``, no ``lm_head`` (the draft uses the target's embedding and LM head).
* ``expected.json``: for each of the target's 12 fixture prompts P = t_0..t_{n-1}, the target's greedy first token
  t_n (``first_tokens``) and the head's ``num_speculative_tokens`` = 4 greedy proposals (``proposals``); then,
  after accepting the target's greedy t_n, t_{n+1}, t_{n+2} (``later_known``), the 4 proposals from there
  (``later_proposals``); ``min_margin`` (smallest top-1 minus top-2 draft logit gap over all proposals), ``seed``,
  ``torch_version``, ``transformers_version``, ``python_version``.

The draft's math (EAGLE-1): for draft inputs (token x_p, feature f_p) at positions p = 0..m-1, where a feature is
the target's last hidden state after its final norm,

    h_p = fc(cat(target.embed_tokens(x_p), f_p))          # embedding first, then feature
    r = h + self_attn(h)                                  # no norm before the attention; causal, RoPE at p
    out = r + mlp(post_attention_layernorm(r))            # no final norm
    draft_hidden_p = out_p;  draft_logits_p = target.lm_head(out_p)

Proposals, given known tokens K = k_0..k_{N} (K = P + [t_n] for ``proposals``, P + [t_n, t_{n+1}, t_{n+2}] for
``later_proposals``): features f_p over K[:-1] (one target pass, no cache); draft inputs x_p = k_{p+1} with f_p for
p = 0..N-1; proposal 1 = argmax of the draft logits at the last position. Proposal i+1: append the input
(proposal i, draft hidden of the previous last position) and rerun the draft over the whole sequence (no cache);
take the argmax at the new last position.

The draft layer is transformers' ``LlamaDecoderLayer`` with its input norm replaced by ``nn.Identity()``, RoPE from
``LlamaRotaryEmbedding`` of the target's config, eager attention; it is checked against a plain-torch version
(own llama3 RoPE) that also re-reads the saved safetensors. The head's seed is re-rolled (from ``BASE_SEED``,
at most ``MAX_REROLLS`` tries) until every proposal's margin is >= ``MIN_MARGIN``, so a float32 argmax elsewhere
cannot pick a different token. Everything is seeded and single-threaded, so re-running rewrites identical files
(for the same torch / transformers versions).

``scripts/make_eagle3_fixture.py`` reuses this script's flow (``make_fixture``: target tokens, re-rolls, writing,
checking), proposal loop (``greedy_draft``), weight init (``init_head``) and plain-torch attention and MLP.
"""

from __future__ import annotations

import argparse
import os

# Never touch the network: everything is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import math
import platform
import shutil
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_DIR = REPO_ROOT / "tests" / "fixtures" / "checkpoints" / "llama"
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "checkpoints" / "llama-eagle"

NUM_SPECULATIVE_TOKENS = 4
NUM_ACCEPTED = 3  # later_known: the target's first 3 greedy tokens
BASE_SEED = 14000
MAX_REROLLS = 50
MIN_MARGIN = 1e-3
MAX_FOLDER_BYTES = 200_000

# Weight init, as scripts/make_test_checkpoints.py: large stds make the logits "peaky".
LINEAR_STD = 0.2
BIAS_STD = 0.1
NORM_STD = 0.1  # norm weights ~ 1 + N(0, NORM_STD)

# Plain-torch vs. transformers layer: float32 tolerance on hidden states / logits.
ATOL = 1e-4
RTOL = 1e-5


def expected_tensor_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The exact tensor names and shapes of the EAGLE-1 head's safetensors file."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    p = "layers.0."
    return {
        "fc.weight": (h, 2 * h),
        "fc.bias": (h,),
        p + "self_attn.q_proj.weight": (hq, h),
        p + "self_attn.k_proj.weight": (hkv, h),
        p + "self_attn.v_proj.weight": (hkv, h),
        p + "self_attn.o_proj.weight": (h, hq),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }


# --------------------------------------------------------------------------
# Target
# --------------------------------------------------------------------------


def load_target() -> LlamaForCausalLM:
    """The ``llama`` fixture checkpoint, float32, eager attention, eval mode."""
    return LlamaForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def target_features(target: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), H) final hidden states after the final norm, one pass without cache."""
    out = target.model(input_ids=torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
    assert out.dtype == torch.float32
    return out


@torch.no_grad()
def target_greedy(target: LlamaForCausalLM, tokens: list[int], num: int) -> list[int]:
    """``num`` greedy tokens, every step a full recompute without cache."""
    ids, new = list(tokens), []
    for _ in range(num):
        logits = target(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        nxt = int(torch.argmax(logits))
        new.append(nxt)
        ids.append(nxt)
    return new


# --------------------------------------------------------------------------
# Draft head: transformers layer and plain torch
# --------------------------------------------------------------------------


class EagleHead(nn.Module):
    """EAGLE-1 head: ``fc`` + one ``LlamaDecoderLayer`` without input norm; no final norm.

    Its ``state_dict`` keys are exactly the checkpoint's tensor names (the rotary buffers are not persistent).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        layer = LlamaDecoderLayer(cfg, layer_idx=0)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(cfg)

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """(m, H) embeddings and features -> (m, H) draft hidden states (causal, positions 0..m-1)."""
        m = embeds.shape[0]
        h = self.fc(torch.cat([embeds, feats], dim=-1))[None]
        pos = torch.arange(m)[None]
        mask = torch.full((m, m), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = self.layers[0](
            h, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary_emb(h, pos)
        )
        return out[0]


def init_head(head: nn.Module, seed: int) -> None:
    """Seeded peaky init: norms 1 + N(0, NORM_STD), biases N(0, BIAS_STD), matrices N(0, LINEAR_STD).

    Parameters only, in ``named_parameters`` order (buffers are untouched). Shared with ``make_eagle3_fixture.py``.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + NORM_STD * noise)
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * noise)
            else:
                p.copy_(LINEAR_STD * noise)


def build_head(cfg: LlamaConfig, seed: int) -> EagleHead:
    head = EagleHead(cfg).to(torch.float32).eval()
    init_head(head, seed)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes == expected_tensor_shapes(cfg), shapes
    return head


def llama3_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """llama3 RoPE inverse frequencies, written out (independently of transformers)."""
    rp = cfg.rope_parameters
    assert rp["rope_type"] == "llama3", rp
    d = cfg.head_dim
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old_ctx = rp["original_max_position_embeddings"]
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(f)
        elif wavelen > old_ctx / low:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float32)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def plain_attention(x: torch.Tensor, w: dict[str, torch.Tensor], p: str, cfg: LlamaConfig,
                    inv_freq: torch.Tensor) -> torch.Tensor:
    """Plain-torch causal GQA self-attention with RoPE at positions 0..m-1, through ``o_proj``.

    ``x`` (m, in): the attention's input; ``w[p + "self_attn.{q,k,v,o}_proj.weight"]``: its weights; ``inv_freq``:
    the RoPE inverse frequencies (d/2,). Shared with ``scripts/make_eagle3_fixture.py``.
    """
    m, d = x.shape[0], cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(m, nq, d).transpose(0, 1)  # (nq, m, d)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(m, nkv, d).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(m, nkv, d).transpose(0, 1)
    angles = torch.arange(m, dtype=torch.float32)[:, None] * inv_freq[None]  # (m, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return t * cos + torch.cat([-t2, t1], dim=-1) * sin

    q, k = rope(q), rope(k)
    # GQA: query head j reads KV head j // (nq / nkv)
    k, v = k.repeat_interleave(nq // nkv, dim=0), v.repeat_interleave(nq // nkv, dim=0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
    attn = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(m, nq * d)
    return attn @ w[p + "self_attn.o_proj.weight"].T


def plain_mlp_block(r: torch.Tensor, w: dict[str, torch.Tensor], p: str, eps: float) -> torch.Tensor:
    """Plain-torch ``r + mlp(post_attention_layernorm(r))`` (SwiGLU). Shared with ``make_eagle3_fixture.py``."""
    x = rms_norm(r, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return r + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def plain_head_forward(w: dict[str, torch.Tensor], cfg: LlamaConfig, embeds, feats) -> torch.Tensor:
    """The same draft layer in plain torch, from the checkpoint's tensors ``w``."""
    h = torch.cat([embeds, feats], dim=-1) @ w["fc.weight"].T + w["fc.bias"]
    r = h + plain_attention(h, w, "layers.0.", cfg, llama3_inv_freq(cfg))
    return plain_mlp_block(r, w, "layers.0.", cfg.rms_norm_eps)


# --------------------------------------------------------------------------
# Proposals
# --------------------------------------------------------------------------


@torch.no_grad()
def greedy_draft(step, tokens: list[int], hidden: torch.Tensor, to_target=None):
    """The ``NUM_SPECULATIVE_TOKENS`` greedy proposals of a draft head, rerunning it over the whole sequence for each.

    ``tokens``, ``hidden``: the draft inputs for known tokens K (x_p = k_{p+1} and the H-wide hidden at p, for
    p = 0..N-1). ``step(tokens, hidden)`` -> ((m, H) draft hidden states, the draft logits at the last position);
    ``to_target(draft_id)`` -> the proposed target id (default: the same id). Each proposal is appended with the
    draft hidden of the previous last position. Returns (proposals, their top-1 minus top-2 margins, and the final
    draft inputs: tokens and hiddens). Shared with ``scripts/make_eagle3_fixture.py``.
    """
    tokens, proposals, margins = list(tokens), [], []
    for _ in range(NUM_SPECULATIVE_TOKENS):
        out, logits = step(tokens, hidden)
        assert out.dtype == logits.dtype == torch.float32
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        draft_id = int(torch.argmax(logits))
        proposals.append(draft_id if to_target is None else to_target(draft_id))
        tokens.append(proposals[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return proposals, margins, tokens[:-1], hidden[:-1]


@torch.no_grad()
def propose(target, head_fn, known: list[int]) -> tuple[list[int], list[float], list[int], torch.Tensor]:
    """The k draft proposals after ``known`` (the context plus the target's latest token).

    ``head_fn(embeds, feats)`` -> draft hidden states. Returns (proposals, their top-1 minus top-2 margins, and
    the final draft inputs: tokens and features).
    """
    embed, lm_head = target.model.embed_tokens, target.lm_head

    def step(tokens, feats):
        hidden = head_fn(embed(torch.tensor(tokens)), feats)
        return hidden, lm_head(hidden[-1])

    return greedy_draft(step, known[1:], target_features(target, known[:-1]))


# --------------------------------------------------------------------------
# Writing and checking
# --------------------------------------------------------------------------


def draft_config() -> dict:
    """The target's config.json with ``num_hidden_layers: 1``."""
    config = json.loads((TARGET_DIR / "config.json").read_text())
    config["num_hidden_layers"] = 1
    return config


@torch.no_grad()
def check_features(target: LlamaForCausalLM, tokens: list[int]) -> None:
    """The features are the hidden states the target's own LM head reads."""
    full = target(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    assert torch.allclose(target.lm_head(target_features(target, tokens)), full, rtol=0, atol=1e-5)


def verify(target, cfg, w, inputs):
    """Check the saved tensors ``w`` and config; the plain-torch head must reproduce the transformers head.

    ``inputs``: the final draft inputs of every proposal run. Returns the plain-torch head (``make_fixture``'s
    ``check_saved``: its proposals must be the same).
    """
    assert {k: tuple(v.shape) for k, v in w.items()} == expected_tensor_shapes(cfg), sorted(w)
    assert all(v.dtype == torch.float32 for v in w.values())
    draft_cfg = LlamaConfig.from_pretrained(OUT_DIR)
    assert draft_cfg.num_hidden_layers == 1 and draft_cfg.architectures == ["LlamaForCausalLM"]
    assert draft_cfg.to_dict() == {**cfg.to_dict(), "num_hidden_layers": 1}

    head = EagleHead(cfg).eval()
    head.load_state_dict(w)
    assert torch.allclose(head.rotary_emb.inv_freq, llama3_inv_freq(cfg), rtol=1e-6, atol=0)

    def plain(embeds, feats):
        return plain_head_forward(w, cfg, embeds, feats)

    embed, lm_head = target.model.embed_tokens, target.lm_head
    with torch.no_grad():
        for toks, feats in inputs:  # the longest draft sequence of every run
            e = embed(torch.tensor(toks))
            a, b = head(e, feats), plain(e, feats)
            assert a.dtype == b.dtype == torch.float32
            assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), float((a - b).abs().max())
            assert torch.allclose(lm_head(a), lm_head(b), rtol=RTOL, atol=ATOL)
    return plain


# --------------------------------------------------------------------------
# The fixture flow (shared with scripts/make_eagle3_fixture.py)
# --------------------------------------------------------------------------


def start(doc: str, argv: list[str] | None) -> None:
    """Parse the (option-less) command line; make torch single-threaded and seeded."""
    argparse.ArgumentParser(description=doc.split("\n\n")[0]).parse_args(argv)
    torch.set_num_threads(1)  # thread count can change float reduction order
    torch.manual_seed(0)


def all_proposals(target, propose, head, prompts, later_known):
    """(proposals, later proposals, min margin, final draft inputs of every run) over all prompts.

    ``propose(target, head, known)`` runs once after P + [t_n] and once after P + ``later_known`` for each prompt P.
    """
    props, later, margins, inputs = [], [], [], []
    for prompt, known3 in zip(prompts, later_known):
        for known, dest in ((prompt + known3[:1], props), (prompt + known3, later)):
            p, m, toks, hidden = propose(target, head, known)
            dest.append(p)
            margins += m
            inputs.append((toks, hidden))
    return props, later, min(margins), inputs


def find_good_head(target, build_head, propose, prompts, later_known, base_seed: int, min_margin: float):
    """Try seeds ``build_head(seed)`` from ``base_seed`` until every proposal margin is >= ``min_margin``."""
    for seed in range(base_seed, base_seed + MAX_REROLLS):
        head = build_head(seed)
        props, later, margin, inputs = all_proposals(target, propose, head, prompts, later_known)
        if margin >= min_margin:
            return head, seed, props, later, margin, inputs
        print(f"  seed {seed}: min margin {margin:.2e} (need {min_margin}), re-rolling")
    raise RuntimeError(f"no seed in {MAX_REROLLS} tries reached a margin of {min_margin}")


def make_fixture(target, target_dir: Path, out_dir: Path, *, config: dict, check_target, build_head, propose,
                 check_saved, base_seed: int, min_margin: float, max_folder_bytes: int,
                 extra_expected: dict | None = None) -> None:
    """(Re)write ``out_dir``: a draft head for ``target`` (the checkpoint in ``target_dir``) and its proposals.

    1. The target's ``NUM_ACCEPTED`` greedy tokens after each of its fixture prompts (``later_known``) are checked
       against its ``expected.json``; ``check_target(target, prompt)`` runs on the first 3 prompts.
    2. ``find_good_head``: seeds from ``base_seed`` for ``build_head(seed)`` until the proposals of
       ``propose(target, head, known)`` (as ``propose`` here) all have margins >= ``min_margin``.
    3. The folder gets ``config`` as config.json, the head's ``state_dict`` as model.safetensors and expected.json
       (``extra_expected``'s keys after ``num_speculative_tokens``).
    4. ``check_saved(w, inputs)`` checks the re-read tensors ``w`` (``inputs``: the final draft inputs of every
       run) and returns a plain-torch head, whose proposals must be the same; the folder must be under
       ``max_folder_bytes``.
    """
    target_expected = json.loads((target_dir / "expected.json").read_text())
    prompts = target_expected["prompts"]
    later_known = [target_greedy(target, p, NUM_ACCEPTED) for p in prompts]
    # The target's fixture was made the same way (greedy, full recompute).
    assert later_known == [o[:NUM_ACCEPTED] for o in target_expected["outputs"]], later_known
    for p in prompts[:3]:
        check_target(target, p)

    head, seed, props, later, margin, inputs = find_good_head(
        target, build_head, propose, prompts, later_known, base_seed, min_margin
    )

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # as save_pretrained
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    expected = {
        "target": target_dir.name,
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        **(extra_expected or {}),
        "prompts": prompts,
        "first_tokens": [k[0] for k in later_known],
        "proposals": props,
        "later_known": later_known,
        "later_proposals": later,
        "min_margin": margin,
        "seed": seed,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
    }
    (out_dir / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")

    with safe_open(out_dir / "model.safetensors", "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}
    plain = check_saved(w, inputs)
    p2, l2, m2, _ = all_proposals(target, propose, plain, prompts, later_known)
    assert (p2, l2) == (props, later), (p2, l2)
    assert abs(m2 - margin) < 1e-4, (m2, margin)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    assert size < max_folder_bytes, size
    print(f"{out_dir.name}: seed {seed}, min margin {margin:.4f}, {size / 1e3:.0f} KB"
          f" -> {out_dir.relative_to(REPO_ROOT)}")


def main(argv: list[str] | None = None) -> None:
    start(__doc__, argv)
    target = load_target()
    cfg = LlamaConfig.from_pretrained(TARGET_DIR)
    cfg._attn_implementation = "eager"
    make_fixture(
        target, TARGET_DIR, OUT_DIR, config=draft_config(), check_target=check_features,
        build_head=lambda seed: build_head(cfg, seed), propose=propose,
        check_saved=lambda w, inputs: verify(target, cfg, w, inputs),
        base_seed=BASE_SEED, min_margin=MIN_MARGIN, max_folder_bytes=MAX_FOLDER_BYTES,
    )


if __name__ == "__main__":
    main()
