#!/usr/bin/env python
"""Generate a tiny random EAGLE-3 draft head for the ``gemma2`` test checkpoint, plus its torch proposals.

The head is a test fixture for jaxserve's EAGLE-3 proposer (the format vLLM's ``method: "eagle3"`` reads, as
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B). CI has no torch, so the reference proposals are computed here once and stored
next to the head. Same structure as ``scripts/make_eagle_fixture.py`` (EAGLE-1), whose flow (``make_fixture``)
and helpers it reuses. Run from the repository root::

    python scripts/make_eagle3_fixture.py

The target is ``tests/fixtures/checkpoints/gemma2`` (``Gemma2ForCausalLM``, 4 layers, H = 64, V = 512): a target
that is not a Llama, with a scaled embedding, so that the head's own (Llama-style) config, the taps and the raw
embedding lookup cannot be confused with the target's. This (re)writes ``tests/fixtures/checkpoints/gemma2-eagle3/``
(deleting it first) with:

* ``config.json``: the head's own Llama-style config (``HEAD_CONFIG``; not a copy of the target's):
  ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, H = 64, intermediate 128, 4 heads, 2 KV
  heads, head_dim 16, 1 layer, silu, rms_norm_eps 1e-6, ``vocab_size: 512``, ``draft_vocab_size: 96``,
  ``rope_theta: 10000.0`` and no rope scaling (default RoPE, as yuhuili's published EAGLE-3 heads),
  ``tie_word_embeddings: false``, bos/eos ids from the target's config, ``torch_dtype: "float32"`` and
  ``eagle_aux_hidden_state_layer_ids: [0, 2, 3]``.
* ``model.safetensors``, names without a ``model.`` prefix: float32 ``fc.weight`` (H, 3H) without bias; one layer
  ``midlayer.*``: ``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm`` (H,), ``self_attn.q/k/v_proj``
  over 2H inputs, ``self_attn.o_proj``, ``mlp.gate/up/down_proj``; the final ``norm.weight`` (H,); its own
  ``lm_head.weight`` (V_d, H) over the V_d = 96 draft ids; int64 ``d2t`` (V_d,): draft id -> target id OFFSET
  (target id = draft id + d2t[draft id]); bool ``t2d`` (V,): True for the target ids in the draft vocabulary. No
  ``embed_tokens`` (the draft uses the target's embedding table). The draft vocabulary is a seeded random sorted
  subset of 96 distinct target ids (``VOCAB_SEED``, not re-rolled).
* ``expected.json``: as EAGLE-1's (for each of the target's 12 fixture prompts P = t_0..t_{n-1}: the target's
  greedy t_n (``first_tokens``), the head's ``num_speculative_tokens`` = 4 greedy proposals after P + [t_n]
  (``proposals``), the 4 after P + [t_n, t_{n+1}, t_{n+2}] (``later_known``, ``later_proposals``), ``min_margin``,
  ``seed``, versions), plus ``aux_layer_ids`` and ``draft_vocab`` (the sorted 96 target ids).

The taps follow vLLM: the target collects its aux hidden states while looping over its layers in order (``if idx
in aux_layers: aux.append(hidden_states + residual)``, the residual stream entering layer idx), so the features are
the INPUTS of the DISTINCT ids in ASCENDING layer order, whatever order the config lists them in; the ids here are
already distinct and ascending. Input of target layer j = transformers' ``output_hidden_states`` entry
``hidden_states[j]``; j = 0 is Gemma's SCALED embedding (the table times sqrt(H)), the input of layer 0.

The draft's math (EAGLE-3): for draft inputs (token x_p, H-wide hidden g_p) at positions p = 0..m-1,

    e = input_layernorm(E[x_p]);  residual = g;  h = hidden_norm(g)    # E: the target's RAW embed_tokens table
    r = residual + o_proj(attention(cat(e, h)))            # q/k/v from 2H; causal, GQA, default RoPE at p
    out = r + mlp(post_attention_layernorm(r))             # SwiGLU
    draft_hidden_p = out_p (pre-norm);  draft_logits_p = lm_head(norm(out_p))      # over the 96 draft ids

E is a plain lookup in the target's ``embed_tokens.weight``, NOT multiplied by Gemma's sqrt(H) normalizer (a head
without ``embed_tokens`` shares the target's table, not the target's embedding function). For a position fed from
the target, g_p = fc(cat(hs[0][p], hs[2][p], hs[3][p])) (3H -> H), hs = the target's ``output_hidden_states``.
Proposals, given known tokens K = k_0..k_N: hs over K[:-1] (one target pass, no cache); draft inputs x_p = k_{p+1}
with g_p = fc(f_p) for p = 0..N-1; proposal 1 = the target id of the argmax draft id at the last position.
Proposal i+1: append the input (proposal i, the draft hidden of the previous last position: ``out``, H wide, not
through ``fc``) and rerun the draft over the whole sequence (no cache); take the argmax at the new last position.

The head is built from transformers' ``LlamaAttention`` (q/k/v_proj replaced by 2H-input ``nn.Linear``),
``LlamaMLP``, ``LlamaRMSNorm`` and ``LlamaRotaryEmbedding`` of the head's config, eager attention, mapping draft
ids with ``d2t``; it is checked against a plain-torch version (own default RoPE, own attention, mapping draft ids
with ``t2d``) that re-reads the saved files. The head's seed is re-rolled (from ``BASE_SEED``, at most
``MAX_REROLLS`` tries) until every proposal's draft-logit margin (top-1 minus top-2 over the 96) is >=
``MIN_MARGIN``. Everything is seeded and single-threaded, so re-running rewrites identical files (for the same
torch / transformers versions).
"""

from __future__ import annotations

import os

# Never touch the network: everything is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import math
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import Gemma2ForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_eagle_fixture import (  # noqa: E402
    ATOL,
    REPO_ROOT,
    RTOL,
    greedy_draft,
    init_head,
    make_fixture,
    plain_attention,
    plain_mlp_block,
    rms_norm,
    start,
)

TARGET_DIR = REPO_ROOT / "tests" / "fixtures" / "checkpoints" / "gemma2"
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "checkpoints" / "gemma2-eagle3"

# vLLM taps the inputs of these target layers in ascending order; they must be distinct (0 = the embeddings).
AUX_LAYER_IDS = [0, 2, 3]
DRAFT_VOCAB_SIZE = 96
VOCAB_SEED = 15999  # the draft vocabulary's seed (fixed, not re-rolled)
BASE_SEED = 15000  # the head's weights (EAGLE-1 uses 14000)
# EAGLE-1's 200 KB cannot hold this head: its float32 weights alone are 63,744 values (255 KB; fc is 3H x H, q/k/v
# take 2H inputs, and it has its own lm_head), so the folder is ~263 KB.
MAX_FOLDER_BYTES = 300_000
# EAGLE-1's 1e-3 is met by the first seeds here, but only just: the head's own 96-wide lm_head over normed hiddens
# gives logits of std ~1.6, so the smallest of 96 top-2 gaps is typically a few 1e-3. Ask for 10x more.
MIN_MARGIN = 1e-2


def head_config() -> dict:
    """The head's config.json: its own Llama-style config (not the target's), with the EAGLE-3 keys."""
    target = json.loads((TARGET_DIR / "config.json").read_text())
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "draft_vocab_size": DRAFT_VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,  # no rope scaling: default RoPE
        "tie_word_embeddings": False,
        "bos_token_id": target["bos_token_id"],
        "eos_token_id": target["eos_token_id"],
        "torch_dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS,
    }


def make_draft_vocab(vocab_size: int) -> list[int]:
    """A seeded random sorted subset of ``DRAFT_VOCAB_SIZE`` distinct target ids."""
    gen = torch.Generator().manual_seed(VOCAB_SEED)
    return sorted(torch.randperm(vocab_size, generator=gen)[:DRAFT_VOCAB_SIZE].tolist())


def expected_tensor_shapes(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The exact tensor names, shapes and dtypes of the EAGLE-3 head's safetensors file."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    f32, p = torch.float32, "midlayer."
    return {
        "fc.weight": ((h, len(AUX_LAYER_IDS) * h), f32),
        p + "input_layernorm.weight": ((h,), f32),
        p + "hidden_norm.weight": ((h,), f32),
        p + "self_attn.q_proj.weight": ((hq, 2 * h), f32),
        p + "self_attn.k_proj.weight": ((hkv, 2 * h), f32),
        p + "self_attn.v_proj.weight": ((hkv, 2 * h), f32),
        p + "self_attn.o_proj.weight": ((h, hq), f32),
        p + "post_attention_layernorm.weight": ((h,), f32),
        p + "mlp.gate_proj.weight": ((i, h), f32),
        p + "mlp.up_proj.weight": ((i, h), f32),
        p + "mlp.down_proj.weight": ((h, i), f32),
        "norm.weight": ((h,), f32),
        "lm_head.weight": ((cfg.draft_vocab_size, h), f32),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
    }


def shapes_of(w: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in w.items()}


def default_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Default (unscaled) RoPE inverse frequencies 1 / theta ** (2i / D), written out (not from transformers)."""
    rp = cfg.rope_parameters
    assert rp["rope_type"] == "default", rp
    d = cfg.head_dim
    return 1.0 / (rp["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


# --------------------------------------------------------------------------
# Target
# --------------------------------------------------------------------------


def load_target() -> Gemma2ForCausalLM:
    """The ``gemma2`` fixture checkpoint, float32, eager attention, eval mode."""
    return Gemma2ForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32, attn_implementation="eager").eval()


def target_embed(target: Gemma2ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), H) rows of the target's RAW ``embed_tokens`` table (no Gemma sqrt(H) normalizer)."""
    return nn.functional.embedding(torch.tensor(tokens), target.model.embed_tokens.weight)


@torch.no_grad()
def target_aux_features(target: Gemma2ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), 3H): cat(hs[j] for j in AUX_LAYER_IDS), hs = ``output_hidden_states``, one pass, no cache."""
    hs = target.model(input_ids=torch.tensor([tokens]), use_cache=False, output_hidden_states=True).hidden_states
    assert len(hs) == target.config.num_hidden_layers + 1
    out = torch.cat([hs[j][0] for j in AUX_LAYER_IDS], dim=-1)
    assert out.dtype == torch.float32
    return out


@torch.no_grad()
def check_hidden_states_are_layer_inputs(target: Gemma2ForCausalLM, tokens: list[int]) -> None:
    """transformers' ``hidden_states[j]`` (j < num layers) is layer j's input; ``hidden_states[0]`` the embeddings
    times Gemma's sqrt(H) normalizer (the raw table is what the head reads)."""
    inputs: list[torch.Tensor] = []

    def grab(module, args, kwargs):
        inputs.append((args[0] if args else kwargs["hidden_states"]).clone())

    hooks = [layer.register_forward_pre_hook(grab, with_kwargs=True) for layer in target.model.layers]
    try:
        ids = torch.tensor([tokens])
        hs = target.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    assert len(inputs) == len(target.model.layers) == len(hs) - 1
    for j, x in enumerate(inputs):
        assert torch.equal(hs[j], x), j
    raw = target_embed(target, tokens)[None]
    assert torch.equal(hs[0], target.model.embed_tokens(ids))
    assert torch.equal(hs[0], raw * math.sqrt(target.config.hidden_size)) and not torch.allclose(hs[0], raw)


# --------------------------------------------------------------------------
# Draft head: transformers pieces and plain torch
# --------------------------------------------------------------------------


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: normed embedding and normed hidden, concatenated, into a 2H-input Llama attention."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, d, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = LlamaAttention(cfg, layer_idx=0)
        for name, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads),
                            ("v_proj", cfg.num_key_value_heads)):
            setattr(self.self_attn, name, nn.Linear(2 * h, heads * d, bias=False))
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, embeds, hidden, mask, position_embeddings):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        r = residual + self.self_attn(x, position_embeddings=position_embeddings, attention_mask=mask)[0]
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(nn.Module):
    """EAGLE-3 head: ``fc`` + ``midlayer`` + final ``norm`` + its own ``lm_head`` over the draft vocabulary.

    Its ``state_dict`` keys are exactly the checkpoint's tensor names (``d2t``/``t2d`` are persistent buffers, the
    rotary buffers are not).
    """

    def __init__(self, cfg: LlamaConfig, draft_vocab: list[int]):
        super().__init__()
        h = cfg.hidden_size
        assert len(draft_vocab) == cfg.draft_vocab_size
        self.fc = nn.Linear(len(cfg.eagle_aux_hidden_state_layer_ids) * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        vocab = torch.tensor(draft_vocab, dtype=torch.int64)
        self.register_buffer("d2t", vocab - torch.arange(len(draft_vocab)))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[vocab] = True
        self.register_buffer("t2d", t2d)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, H) target embeddings and draft hiddens -> ((m, H) pre-norm outputs, (m, V_d) draft logits)."""
        m = embeds.shape[0]
        pos = torch.arange(m)[None]
        mask = torch.full((m, m), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = self.midlayer(embeds[None], hidden[None], mask, self.rotary_emb(embeds[None], pos))[0]
        return out, self.lm_head(self.norm(out))

    def to_target(self, draft_id: int) -> int:
        return draft_id + int(self.d2t[draft_id])


def build_head(cfg: LlamaConfig, draft_vocab: list[int], seed: int) -> Eagle3Head:
    head = Eagle3Head(cfg, draft_vocab).to(torch.float32).eval()
    init_head(head, seed)  # EAGLE-1's: the head has no biases; d2t/t2d are buffers, untouched
    assert shapes_of(head.state_dict()) == expected_tensor_shapes(cfg), shapes_of(head.state_dict())
    return head


class PlainEagle3:
    """The same head in plain torch from the checkpoint's tensors ``w``; maps draft ids with ``t2d`` (not d2t)."""

    def __init__(self, w: dict[str, torch.Tensor], cfg: LlamaConfig):
        self.w, self.cfg = w, cfg
        self.vocab = torch.nonzero(w["t2d"])[:, 0].tolist()  # ascending target ids: draft id i -> vocab[i]

    def fc(self, feats: torch.Tensor) -> torch.Tensor:
        return feats @ self.w["fc.weight"].T

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, cfg, eps, p = self.w, self.cfg, self.cfg.rms_norm_eps, "midlayer."
        x = torch.cat([rms_norm(embeds, w[p + "input_layernorm.weight"], eps),
                       rms_norm(hidden, w[p + "hidden_norm.weight"], eps)], dim=-1)  # (m, 2H)
        r = hidden + plain_attention(x, w, p, cfg, default_inv_freq(cfg))
        out = plain_mlp_block(r, w, p, eps)
        return out, rms_norm(out, w["norm.weight"], eps) @ w["lm_head.weight"].T

    def to_target(self, draft_id: int) -> int:
        return self.vocab[draft_id]


# --------------------------------------------------------------------------
# Proposals
# --------------------------------------------------------------------------


@torch.no_grad()
def propose(target, head, known: list[int]) -> tuple[list[int], list[float], list[int], torch.Tensor]:
    """The k draft proposals (target ids) after ``known`` (the context plus the target's latest token).

    ``head`` has ``fc(feats)``, ``head(embeds, hidden)`` -> (pre-norm outputs, draft logits) and
    ``to_target(draft_id)``. Returns (proposals, their draft-logit top-1 minus top-2 margins, and the final draft
    inputs: tokens and hiddens).
    """

    def step(tokens, hidden):
        out, logits = head(target_embed(target, tokens), hidden)
        assert logits.shape[-1] == DRAFT_VOCAB_SIZE
        return out, logits[-1]

    return greedy_draft(step, known[1:], head.fc(target_aux_features(target, known[:-1])), head.to_target)


# --------------------------------------------------------------------------
# Checking
# --------------------------------------------------------------------------


def verify(target, cfg, draft_vocab, w, inputs) -> PlainEagle3:
    """Check the saved tensors ``w``, config and vocabulary; the plain-torch head must reproduce the transformers head.

    ``inputs``: the final draft inputs of every proposal run. Returns the plain-torch head (``make_fixture``'s
    ``check_saved``: its proposals must be the same).
    """
    assert shapes_of(w) == expected_tensor_shapes(cfg), shapes_of(w)
    draft_cfg = LlamaConfig.from_pretrained(OUT_DIR)
    assert draft_cfg.architectures == ["LlamaForCausalLMEagle3"] and draft_cfg.num_hidden_layers == 1
    assert draft_cfg.draft_vocab_size == DRAFT_VOCAB_SIZE
    assert draft_cfg.eagle_aux_hidden_state_layer_ids == AUX_LAYER_IDS
    assert draft_cfg.to_dict() == cfg.to_dict()
    assert json.loads((OUT_DIR / "config.json").read_text()) == head_config()
    assert draft_cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}, draft_cfg.rope_parameters
    vocab = torch.tensor(draft_vocab)
    assert torch.equal(w["d2t"] + torch.arange(DRAFT_VOCAB_SIZE), vocab)
    assert torch.equal(torch.nonzero(w["t2d"])[:, 0], vocab) and bool((vocab[1:] > vocab[:-1]).all())
    expected = json.loads((OUT_DIR / "expected.json").read_text())
    assert expected["draft_vocab"] == draft_vocab and expected["aux_layer_ids"] == AUX_LAYER_IDS
    assert all(t in draft_vocab for run in expected["proposals"] + expected["later_proposals"] for t in run)

    draft_cfg._attn_implementation = "eager"
    head = Eagle3Head(draft_cfg, draft_vocab).eval()
    head.load_state_dict(w)
    assert torch.allclose(head.rotary_emb.inv_freq, default_inv_freq(draft_cfg), rtol=1e-6, atol=0)
    plain = PlainEagle3(w, draft_cfg)

    with torch.no_grad():
        for toks, hidden in inputs:  # the longest draft sequence of every run
            e = target_embed(target, toks)
            (a, la), (b, lb) = head(e, hidden), plain(e, hidden)
            assert a.dtype == b.dtype == la.dtype == lb.dtype == torch.float32
            assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), float((a - b).abs().max())
            assert torch.allclose(la, lb, rtol=RTOL, atol=ATOL), float((la - lb).abs().max())
        for prompt in expected["prompts"][:3]:
            f = target_aux_features(target, prompt)
            assert torch.allclose(head.fc(f), plain.fc(f), rtol=RTOL, atol=ATOL)
    for draft_id in range(DRAFT_VOCAB_SIZE):
        assert head.to_target(draft_id) == plain.to_target(draft_id) == draft_vocab[draft_id]
    return plain


def main(argv: list[str] | None = None) -> None:
    start(__doc__, argv)
    target = load_target()
    cfg = LlamaConfig.from_dict(head_config())  # the head's config: RoPE and sizes come from it
    cfg._attn_implementation = "eager"
    draft_vocab = make_draft_vocab(cfg.vocab_size)
    # vLLM taps distinct layers in ascending order: list them that way, so fc's input blocks are in the same order.
    assert AUX_LAYER_IDS == sorted(set(AUX_LAYER_IDS)) and max(AUX_LAYER_IDS) < target.config.num_hidden_layers
    assert (cfg.hidden_size, cfg.vocab_size) == (target.config.hidden_size, target.config.vocab_size)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}, cfg.rope_parameters
    assert cfg.head_dim == 16 and cfg.hidden_act == "silu" and not cfg.tie_word_embeddings
    make_fixture(
        target, TARGET_DIR, OUT_DIR, config=head_config(),
        check_target=check_hidden_states_are_layer_inputs,  # aux id j is the input of target layer j
        build_head=lambda seed: build_head(cfg, draft_vocab, seed), propose=propose,
        check_saved=lambda w, inputs: verify(target, cfg, draft_vocab, w, inputs),
        extra_expected={"aux_layer_ids": AUX_LAYER_IDS, "draft_vocab": draft_vocab},
        base_seed=BASE_SEED, min_margin=MIN_MARGIN, max_folder_bytes=MAX_FOLDER_BYTES,
    )


if __name__ == "__main__":
    main()
