#!/usr/bin/env python
"""Generate a tiny random EAGLE-3 head for the ``gemma2`` test checkpoint in the speculators format, plus its torch
proposals.

The format is the `speculators` library's (vllm-project/speculators, RedHatAI's ``*.speculator.eagle3`` heads),
which vLLM reads by its ``speculators_model_type``. The head is ``scripts/make_eagle3_fixture.py``'s (same target,
sizes, draft vocabulary, taps, flow and checks; see its docstring), with three differences:

* ``config.json`` is speculators': ``architectures: ["Eagle3Speculator"]``, ``speculators_model_type: "eagle3"``,
  the layer's own config under ``transformer_layer_config`` (a Llama config as speculators writes it, with
  ``to_diff_dict`` under transformers 4: only what differs from ``LlamaConfig``'s defaults), ``draft_vocab_size``,
  ``norm_before_residual: true``, ``eagle_aux_hidden_state_layer_ids``, ``target_hidden_size: null`` and a
  ``speculators_config`` naming the verifier;
* the tensors of its layer are ``layers.0.*`` (not ``midlayer.*``);
* the layer's residual is the NORMED hidden state (speculators' ``norm_before_residual``, as its
  ``LlamaDecoderEagle3FirstLayer`` computes it):

      e = input_layernorm(E[x_p]);  h = hidden_norm(g);  residual = h
      r = residual + o_proj(attention(cat(e, h)));  out = r + mlp(post_attention_layernorm(r))

This (re)writes ``tests/fixtures/checkpoints/gemma2-eagle3-speculators/``. Run from the repository root::

    python scripts/make_speculators_eagle3_fixture.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_eagle3_fixture as eagle3  # noqa: E402
from make_eagle_fixture import (  # noqa: E402
    ATOL,
    REPO_ROOT,
    RTOL,
    init_head,
    make_fixture,
    plain_attention,
    plain_mlp_block,
    rms_norm,
    start,
)

OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "checkpoints" / "gemma2-eagle3-speculators"
BASE_SEED = 16000  # the head's weights (make_eagle3_fixture.py's use 15000)
PREFIX = "layers.0."  # speculators' name of the head's one layer
EAGLE_KEYS = ("architectures", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids")  # not the layer's


def layer_config() -> dict:
    """The layer's config as speculators writes it (``to_diff_dict``, which under transformers 4 leaves out every
    value equal to ``LlamaConfig``'s default): its model_type and what differs from the defaults."""
    fields = {k: v for k, v in eagle3.head_config().items() if k not in EAGLE_KEYS}
    full, defaults = LlamaConfig(**fields).to_dict(), LlamaConfig().to_dict()
    return {k: v for k, v in full.items() if k == "model_type" or defaults.get(k) != v}


def head_config() -> dict:
    """The head's config.json in speculators' format."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer_config(),
        "draft_vocab_size": eagle3.DRAFT_VOCAB_SIZE,
        "norm_before_residual": True,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": eagle3.AUX_LAYER_IDS,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
            "verifier": {"name_or_path": "tests/fixtures/checkpoints/gemma2", "architectures": ["Gemma2ForCausalLM"]},
        },
    }


class NormedResidualLayer(eagle3.Eagle3Layer):
    """The EAGLE-3 layer whose residual is the normed hidden state (``norm_before_residual``)."""

    def forward(self, embeds, hidden, mask, position_embeddings):
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        r = normed + self.self_attn(x, position_embeddings=position_embeddings, attention_mask=mask)[0]
        return r + self.mlp(self.post_attention_layernorm(r))


class SpeculatorsHead(eagle3.Eagle3Head):
    """make_eagle3_fixture.py's head with its layer as ``layers.0`` and a normed residual."""

    def __init__(self, cfg: LlamaConfig, draft_vocab: list[int]):
        super().__init__(cfg, draft_vocab)
        del self.midlayer
        self.layers = nn.ModuleList([NormedResidualLayer(cfg)])

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, H) target embeddings and draft hiddens -> ((m, H) pre-norm outputs, (m, V_d) draft logits)."""
        m = embeds.shape[0]
        pos = torch.arange(m)[None]
        mask = torch.full((m, m), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = self.layers[0](embeds[None], hidden[None], mask, self.rotary_emb(embeds[None], pos))[0]
        return out, self.lm_head(self.norm(out))


def expected_tensor_shapes(cfg: LlamaConfig) -> dict:
    """make_eagle3_fixture.py's tensors, the layer's named ``layers.0.*``."""
    return {name.replace("midlayer.", PREFIX): shape for name, shape in eagle3.expected_tensor_shapes(cfg).items()}


def build_head(cfg: LlamaConfig, draft_vocab: list[int], seed: int) -> SpeculatorsHead:
    head = SpeculatorsHead(cfg, draft_vocab).to(torch.float32).eval()
    init_head(head, seed)
    assert eagle3.shapes_of(head.state_dict()) == expected_tensor_shapes(cfg), eagle3.shapes_of(head.state_dict())
    return head


class PlainSpeculators(eagle3.PlainEagle3):
    """The same head in plain torch from the checkpoint's tensors."""

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, cfg, eps = self.w, self.cfg, self.cfg.rms_norm_eps
        normed = rms_norm(hidden, w[PREFIX + "hidden_norm.weight"], eps)  # (m, H)
        x = torch.cat([rms_norm(embeds, w[PREFIX + "input_layernorm.weight"], eps), normed], dim=-1)  # (m, 2H)
        r = normed + plain_attention(x, w, PREFIX, cfg, eagle3.default_inv_freq(cfg))
        out = plain_mlp_block(r, w, PREFIX, eps)
        return out, rms_norm(out, w["norm.weight"], eps) @ w["lm_head.weight"].T


def verify(target, cfg: LlamaConfig, draft_vocab: list[int], w: dict, inputs) -> PlainSpeculators:
    """The saved tensors, config and vocabulary; the plain-torch head must reproduce the module head."""
    assert eagle3.shapes_of(w) == expected_tensor_shapes(cfg), eagle3.shapes_of(w)
    saved = json.loads((OUT_DIR / "config.json").read_text())
    assert saved == head_config()
    layer = LlamaConfig(**saved["transformer_layer_config"])
    assert {k: getattr(layer, k) for k in ("hidden_size", "head_dim", "num_key_value_heads", "rms_norm_eps")} == {
        k: getattr(cfg, k) for k in ("hidden_size", "head_dim", "num_key_value_heads", "rms_norm_eps")}
    assert "rms_norm_eps" not in saved["transformer_layer_config"]  # a default: speculators leaves it out
    head = SpeculatorsHead(cfg, draft_vocab).eval()
    head.load_state_dict(w)
    plain = PlainSpeculators(w, cfg)
    with torch.no_grad():
        for toks, hidden in inputs:
            e = eagle3.target_embed(target, toks)
            (a, la), (b, lb) = head(e, hidden), plain(e, hidden)
            assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), float((a - b).abs().max())
            assert torch.allclose(la, lb, rtol=RTOL, atol=ATOL), float((la - lb).abs().max())
            residual_raw = eagle3.PlainEagle3({k.replace(PREFIX, "midlayer."): v for k, v in w.items()}, cfg)
            assert not torch.allclose(residual_raw(e, hidden)[0], a), "the normed residual must change the output"
    return plain


def main(argv: list[str] | None = None) -> None:
    start(__doc__, argv)
    target = eagle3.load_target()
    cfg = LlamaConfig.from_dict(eagle3.head_config())
    cfg._attn_implementation = "eager"
    draft_vocab = eagle3.make_draft_vocab(cfg.vocab_size)
    make_fixture(
        target, eagle3.TARGET_DIR, OUT_DIR, config=head_config(),
        check_target=eagle3.check_hidden_states_are_layer_inputs,
        build_head=lambda seed: build_head(cfg, draft_vocab, seed), propose=eagle3.propose,
        check_saved=lambda w, inputs: verify(target, cfg, draft_vocab, w, inputs),
        extra_expected={"aux_layer_ids": eagle3.AUX_LAYER_IDS, "draft_vocab": draft_vocab},
        base_seed=BASE_SEED, min_margin=eagle3.MIN_MARGIN, max_folder_bytes=eagle3.MAX_FOLDER_BYTES,
    )


if __name__ == "__main__":
    main()
