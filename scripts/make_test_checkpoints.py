#!/usr/bin/env python
"""Generate tiny random Hugging Face checkpoints plus their HF greedy outputs.

The checkpoints are test fixtures for jaxserve: CI has no torch, so the
reference outputs of the Hugging Face (torch) implementation are computed here
once and stored next to each checkpoint.

For every model in ``MODELS`` this writes ``tests/fixtures/checkpoints/<name>/``
containing a complete HF model folder (config.json, safetensors weights,
generation_config.json, tokenizer files) and:

* ``expected.json``: ``prompts`` (12 token-id lists), ``outputs`` (20 greedy
  tokens per prompt), ``min_margin`` (smallest top-1 minus top-2 logit gap over
  all greedy steps), ``torch_version``, ``transformers_version`` (plus
  ``seed`` and ``python_version`` for provenance).
* ``expected_logits.npy``: float32 ``(12, vocab)`` logits of the last prompt
  position of each prompt.

Mixture-of-experts models (mixtral, qwen3-moe) must also keep every router
decision clear: over all greedy steps, the gap between the k-th and (k+1)-th
largest router logit of every token in every layer must be at least
``MIN_ROUTER_MARGIN``, else the seed is re-rolled; expected.json then also has
``min_router_margin``. Their experts are saved in the Hub's per-expert layout
(``...experts.<e>.w1.weight`` / ``...experts.<e>.gate_proj.weight``), which is
what transformers v5's ``save_pretrained`` writes back from its fused
in-memory ``experts.gate_up_proj`` / ``experts.down_proj``.

Everything is seeded, so re-running the script rewrites identical files (for
the same Python / torch / transformers versions: the tokenizer is trained on
standard-library source text). Run from the repository root::

    python scripts/make_test_checkpoints.py                 # every model
    python scripts/make_test_checkpoints.py gemma2 mixtral  # only these

Naming models regenerates only their folders and leaves the others untouched
(regenerating a folder deletes it first, including fixture files other scripts
added to it, such as ``expected_prompt_logprobs.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import os

# Never touch the network: everything is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import inspect
import json
import platform
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "checkpoints"

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0, 1, 2, 3
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

PROMPT_LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 48, 70]
PROMPT_SEED = 1234
NUM_NEW_TOKENS = 20
MIN_MARGIN = 1e-3
MIN_ROUTER_MARGIN = 1e-3  # MoE: k-th minus (k+1)-th router logit, every token and layer
# DeepSeek routes on sigmoid scores, in (0, 1): their gaps are a few times smaller than logits' (no seed of 50 reaches
# 1e-3), still 100x the float32 differences between torch and JAX (~1e-6)
ROUTER_MARGIN_OVERRIDES = {"deepseek-v3": 2e-4, "deepseek-v3-q-proj": 2e-4}
MAX_REROLLS = 50

# Weight init: large stds make the logits "peaky", so greedy decoding does not
# flip on float32 rounding differences between torch and JAX.
LINEAR_STD = 0.2
EMBED_STD = 0.3
BIAS_STD = 0.1
NORM_STD = 0.1  # norm weights ~ 1 + N(0, NORM_STD)

# Per-model changes to the weight init (keyword arguments of init_peaky_weights).
# Gemma's RMSNorm scales by (1 + weight) and its embeddings are multiplied by
# sqrt(hidden_size) (= 8) and tied to the LM head. With the default init the
# scaled embedding of the current token dominates the residual stream and the
# (tied) logits, so greedy decoding just repeats the last token. Hence for
# Gemma: small embeddings, stored norm weights centred on 0 (effective scale
# ~1, as in the other models) except the post-attention / post-feed-forward
# norms and the final norm, centred on 4 (effective scale ~5: the sub-layer
# outputs outweigh the scaled embedding, and the logits stay large).
GEMMA_INIT = dict(
    embed_std=0.05,
    norm_centre=0.0,
    norm_centres={
        "post_attention_layernorm": 4.0,
        "post_feedforward_layernorm": 4.0,
        "model.norm.": 4.0,
    },
)
INIT_OVERRIDES = {"gemma": GEMMA_INIT, "gemma2": GEMMA_INIT, "gemma3": GEMMA_INIT}

# config.json keys renamed after saving so that the file says what the Hub's
# checkpoints say (transformers reads both spellings): Qwen3MoeConfig's
# attribute_map makes save_pretrained write ``num_local_experts``, while the
# Hub's Qwen3-MoE configs (e.g. Qwen/Qwen3-30B-A3B) have ``num_experts``.
CONFIG_KEY_RENAMES = {"qwen3-moe": {"num_local_experts": "num_experts"}}

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    dtype="float32",
)

# name -> (model class, config class, config overrides, base seed, max shard size)
MODELS = {
    "llama": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        1000,
        "400KB",  # ~560 KB of weights -> two shards + model.safetensors.index.json
    ),
    "llama-linear": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            num_key_value_heads=4,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
        2000,
        None,
    ),
    "mistral": (
        MistralForCausalLM,
        MistralConfig,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            sliding_window=16,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        3000,
        None,
    ),
    "qwen2": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        4000,
        None,
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config,
        dict(
            num_key_value_heads=2,
            head_dim=32,  # != hidden_size / num_attention_heads (= 16)
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        5000,
        None,
    ),
    # Gemma 2: layers alternate sliding (even index) / global (odd index);
    # attention and final logit soft-capping small enough to bite on these
    # peaky weights; query_pre_attn_scalar != head_dim; tied embeddings.
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config,
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=16,
            # = the config's default: layer i global iff (i + 1) % 2 == 0.
            layer_types=["sliding_attention", "full_attention"] * 2,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        6000,
        None,
    ),
    # Gemma 3 (text-only, like gemma-3-1b): 5 local : 1 global in the real
    # models, here 2 : 1 (sliding_window_pattern 3 -> s s g s s g); local rope
    # base 1e4, global rope base 1e6 with linear scaling (Gemma 3 4B+ uses
    # factor 8 on the global layers); q_norm / k_norm; one KV head;
    # head_dim 32 != hidden / heads; no soft-capping (as on the Hub).
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        dict(
            num_hidden_layers=6,
            intermediate_size=64,
            num_key_value_heads=1,
            head_dim=32,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=16,
            # The Hub's configs still carry the pattern; the config turns it
            # into layer_types (layer i global iff (i + 1) % 3 == 0).
            sliding_window_pattern=3,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            tie_word_embeddings=True,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1000000.0),
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            ),
        ),
        7000,
        None,
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig,
        dict(
            intermediate_size=64,  # per expert; keeps the folder < 1 MB
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        8000,
        None,
    ),
    "qwen3-moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        dict(
            num_key_value_heads=2,
            head_dim=32,  # != hidden_size / num_attention_heads (= 16)
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        9000,
        None,
    ),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's q/k/v biases,
    # top-2 of 4 experts without renormalising (norm_topk_prob false, as on
    # the Hub), and a shared expert of its own inner size behind a sigmoid gate.
    "qwen2-moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig,
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        11000,
        None,
    ),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj; LongRoPE with an
    # original context of 32 (a sequence longer than that runs on the long
    # factors, and the attention factor sqrt(1 + ln 4 / ln 32) scales cos and
    # sin); half of each head rotary (Phi-4-mini's partial_rotary_factor is
    # 0.75); a sliding window of 48 (Phi-3-mini-4k's is 2047).
    "phi3": (
        Phi3ForCausalLM,
        Phi3Config,
        dict(
            num_key_value_heads=2,
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            sliding_window=48,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                original_max_position_embeddings=32,
                short_factor=[1.0, 1.1, 1.3, 1.6],
                long_factor=[1.0, 2.5, 6.0, 12.0],
            ),
        ),
        10000,
        None,
    ),
    # Gemma (the first, and CodeGemma): the Llama layer with (1 + w) norms,
    # GeGLU, scaled tied embeddings; one KV head (gemma-2b's MQA), head_dim 32.
    "gemma": (
        GemmaForCausalLM,
        GemmaConfig,
        dict(
            num_key_value_heads=1,
            head_dim=32,
            hidden_act="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        14000,
        None,
    ),
    # Granite 3.x: the Llama layer with its four multipliers, none 1 (the
    # published 8B's: embeddings x12, attention scale 1/128, residual x0.22,
    # logits /16; here milder so greedy decoding stays peaky).
    "granite": (
        GraniteForCausalLM,
        GraniteConfig,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            embedding_multiplier=3.0,
            attention_multiplier=0.125,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        12000,
        None,
    ),
    # OLMo 2: norms after the attention and the MLP (none before), q/k
    # RMSNorms over the whole projection width.
    "olmo2": (
        Olmo2ForCausalLM,
        Olmo2Config,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        ),
        13000,
        None,
    ),
    # gpt-oss: attention with q/k/v/o biases and a learned sink logit per
    # head, sliding (a window of 16; the release's is 128) and full layers
    # alternating, YaRN (the release's factor 32 over 4096; here 4 over 128),
    # and 4 experts, top-2 (the release's 32 or 128, top-4), each with biases,
    # gate and up interleaved in one fused tensor and the clamped gated
    # activation; the fused expert tensors stay fused on disk (transformers'
    # and the Hub's BF16 layout).
    "gpt-oss": (
        GptOssForCausalLM,
        GptOssConfig,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=128,
                truncate=False,
            ),
        ),
        15000,
        None,
    ),
    # DeepSeek-V3 (and R1, Kimi K2, Moonlight: DeepseekV3ForCausalLM): multi-head
    # latent attention (q through a low-rank q_a / q_a_layernorm / q_b, k and v
    # from one compressed latent and a shared rotary key, v narrower than the
    # no-rope part of q and k), interleaved rope with YaRN and its mscale on the
    # softmax, a dense first layer then sparse ones: sigmoid routing with a
    # score-correction bias, top-1 of 2 expert groups, top-2 of 8 experts,
    # renormalised and scaled by routed_scaling_factor, plus a shared expert.
    "deepseek-v3": (
        DeepseekV3ForCausalLM,
        DeepseekV3Config,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,  # MLA: as many as the query heads (the class default is V3's 128)
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=2.0,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=256,
            ),
        ),
        16000,
        None,
    ),
    # DeepSeek-V3's other layout (Moonlight-16B-A3B's): one q_proj (no q_lora_rank), every layer sparse (no
    # dense first layer), one expert group, two shared experts, weights not renormalised, plain rope laid out
    # rotate-half (rope_interleave false).
    "deepseek-v3-q-proj": (
        DeepseekV3ForCausalLM,
        DeepseekV3Config,
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            moe_intermediate_size=32,
            first_k_dense_replace=0,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            rope_interleave=False,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=50000.0),
        ),
        17000,
        None,
    ),
}
FUSED_EXPERTS = ("gpt-oss",)  # saved with their experts fused, as their Hub checkpoints are


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def training_corpus() -> list[str]:
    """Return Python standard-library source text to train the tokenizer on."""
    import collections
    import functools
    import json as json_mod
    import textwrap

    return [inspect.getsource(m) for m in (textwrap, functools, collections, json_mod.decoder)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with exactly ``VOCAB_SIZE`` entries."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def make_config(name: str):
    """Build the transformers config for model ``name``."""
    _, config_cls, overrides, _, _ = MODELS[name]
    config = config_cls(**{**COMMON, **overrides})
    config._attn_implementation = "eager"
    if hasattr(config, "num_experts_per_tok"):
        # MoE: the plain per-expert loop for the reference outputs, not the
        # grouped_mm default (verify_reload then checks the default path too).
        config._experts_implementation = "eager"
    return config


def init_peaky_weights(
    model: torch.nn.Module,
    seed: int,
    norm_centre: float = 1.0,
    norm_centres: dict[str, float] | None = None,
    embed_std: float | None = None,
) -> None:
    """Re-initialise every parameter with large-std random values.

    Norm weights become ``centre + N(0, NORM_STD)``, where ``centre`` is the
    value of the first ``norm_centres`` key contained in the parameter name,
    else ``norm_centre``; biases ``N(0, BIAS_STD)``, embeddings
    ``N(0, embed_std)`` (default ``EMBED_STD``), other matrices (MoE routers
    and fused expert tensors included) ``N(0, LINEAR_STD)``. Tied parameters
    are visited once (``named_parameters`` de-duplicates).
    """
    embed_std = EMBED_STD if embed_std is None else embed_std
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                centre = next(
                    (c for key, c in (norm_centres or {}).items() if key in name), norm_centre
                )
                p.copy_(centre + NORM_STD * noise)
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(embed_std * noise)
            else:
                p.copy_(LINEAR_STD * noise)


def build_model(name: str, seed: int) -> torch.nn.Module:
    """Instantiate model ``name`` in float32 eval mode with peaky weights (and, for DeepSeek's routers, a random
    score-correction bias: a buffer, zero otherwise)."""
    model_cls = MODELS[name][0]
    model = model_cls(make_config(name)).to(torch.float32).eval()
    init_peaky_weights(model, seed, **INIT_OVERRIDES.get(name, {}))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(0.2 * torch.randn(module.num_experts, generator=gen))
    return model


# --------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------


def make_prompts() -> list[list[int]]:
    """Random prompts of ``PROMPT_LENGTHS`` drawn from the non-special ids."""
    rng = np.random.default_rng(PROMPT_SEED)
    low = len(SPECIAL_TOKENS)
    return [rng.integers(low, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def greedy_decode(
    model, prompt: list[int], num_new_tokens: int = NUM_NEW_TOKENS
) -> tuple[list[int], float, np.ndarray]:
    """Greedy-decode ``num_new_tokens`` tokens, ignoring EOS, without KV cache.

    Every step runs the full sequence through the model and takes the argmax of
    the last position. Returns (new tokens, min top1-top2 logit margin, float32
    logits of the last prompt position).
    """
    ids = list(prompt)
    new_tokens, margins, first_logits = [], [], None
    for _ in range(num_new_tokens):
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
        logits = out.logits[0, -1].to(torch.float32)
        if first_logits is None:
            first_logits = logits.numpy().copy()
        top2 = torch.topk(logits, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        nxt = int(torch.argmax(logits))
        new_tokens.append(nxt)
        ids.append(nxt)
    return new_tokens, min(margins), first_logits


def reference_outputs(model, prompts):
    """Run ``greedy_decode`` on every prompt; return (outputs, min margin, logits)."""
    outputs, margins, logits = [], [], []
    for prompt in prompts:
        toks, margin, last_logits = greedy_decode(model, prompt)
        outputs.append(toks)
        margins.append(margin)
        logits.append(last_logits)
    return outputs, min(margins), np.stack(logits).astype(np.float32)


@contextlib.contextmanager
def router_margins(model):
    """Collect MoE router margins while the block runs; yields a list of floats.

    Every router (transformers' ``*TopKRouter`` modules: a ``top_k``
    attribute, forward returns the router logits first) gets a forward hook
    that appends, per call, the smallest gap between the k-th and (k+1)-th
    largest router logit over the call's tokens. Softmax is monotonic,
    so this is the margin of the top-k expert choice. Empty for dense models.
    """
    margins: list[float] = []

    def hook(module, _inputs, output):
        logits = output[0].detach().to(torch.float32)
        if hasattr(module, "e_score_correction_bias"):  # DeepSeek: the groups' choice, then the experts' in them
            margins.append(deepseek_router_margin(module, logits))
            return
        top = torch.topk(logits, module.top_k + 1, dim=-1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if type(m).__name__.lower().endswith("topkrouter")
    ]
    try:
        yield margins
    finally:
        for h in handles:
            h.remove()


def deepseek_router_margin(router, logits: torch.Tensor) -> float:
    """The smallest margin of a DeepSeek router's two choices over a call's tokens: the topk_group-th minus the
    next group score (each group's top-2 biased sigmoid scores summed), and within the chosen groups the k-th minus
    the (k+1)-th biased score."""
    scores = logits.sigmoid() + router.e_score_correction_bias
    groups = scores.view(-1, router.num_group, router.num_experts // router.num_group)
    group_scores = groups.topk(2, dim=-1).values.sum(-1)  # (T, groups)
    if router.topk_group == router.num_group:  # every group kept: no choice to make
        group_margin, keep = float("inf"), torch.ones_like(group_scores, dtype=torch.bool)
    else:
        top_groups = group_scores.topk(router.topk_group + 1, dim=-1)
        group_margin = (top_groups.values[:, -2] - top_groups.values[:, -1]).min()
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, top_groups.indices[:, :-1], True)
    masked = groups.masked_fill(~keep[..., None], float("-inf")).view(scores.shape)
    top = masked.topk(router.top_k + 1, dim=-1).values
    return float(min(group_margin, (top[:, -2] - top[:, -1]).min()))


def find_good_model(name: str, prompts):
    """Try seeds from the model's base seed until every margin is large enough.

    The greedy top-1/top-2 logit margins must be >= ``MIN_MARGIN`` and, for MoE
    models, every router top-k decision margin >= ``MIN_ROUTER_MARGIN`` (or its ``ROUTER_MARGIN_OVERRIDES``)
    (``None`` for dense models).
    """
    base_seed = MODELS[name][3]
    for seed in range(base_seed, base_seed + MAX_REROLLS):
        model = build_model(name, seed)
        with router_margins(model) as rmargins:
            outputs, min_margin, logits = reference_outputs(model, prompts)
        min_router = min(rmargins) if rmargins else None
        router_margin = ROUTER_MARGIN_OVERRIDES.get(name, MIN_ROUTER_MARGIN)
        if min_margin >= MIN_MARGIN and (min_router is None or min_router >= router_margin):
            return model, seed, outputs, min_margin, min_router, logits
        print(
            f"  {name}: seed {seed} min margin {min_margin:.2e} (need {MIN_MARGIN}), "
            f"min router margin {min_router} (need {router_margin}), re-rolling"
        )
    raise RuntimeError(f"{name}: no seed in {MAX_REROLLS} tries reached the margins")


# --------------------------------------------------------------------------
# Writing and checking
# --------------------------------------------------------------------------


def save_checkpoint(name, model, tokenizer, folder: Path) -> None:
    """Write model weights (safetensors), config, generation config, tokenizer."""
    max_shard_size = MODELS[name][4]
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    # transformers v5 always writes safetensors (the old safe_serialization
    # flag is gone), so no flag is needed here.
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    tokenizer.save_pretrained(folder)
    renames = CONFIG_KEY_RENAMES.get(name)
    if renames:
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        config = {renames.get(k, k): v for k, v in config.items()}
        # Same layout as PreTrainedConfig.to_json_string.
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if max_shard_size:
        shards = sorted(folder.glob("model-*.safetensors"))
        assert len(shards) == 2 and (folder / "model.safetensors.index.json").exists(), shards
    if hasattr(model.config, "num_experts_per_tok") and name not in FUSED_EXPERTS:
        # The Hub layout: one tensor per expert and projection, nothing fused.
        names = [k for f in folder.glob("*.safetensors") for k in safe_open(f, "pt").keys()]
        fused = [k for k in names if "gate_up_proj" in k or k.endswith("experts.down_proj")]
        assert not fused, fused
        assert any(".experts.0." in k for k in names), names


def save_expected(
    folder: Path, seed, prompts, outputs, min_margin, logits, min_router=None
) -> None:
    """Write expected.json and expected_logits.npy (``min_router_margin`` for MoE only)."""
    expected = {
        "prompts": prompts,
        "outputs": outputs,
        "min_margin": min_margin,
        **({"min_router_margin": min_router} if min_router is not None else {}),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "seed": seed,
        "python_version": platform.python_version(),
    }
    (folder / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    np.save(folder / "expected_logits.npy", logits)


def verify_reload(folder: Path, prompts, outputs, tokenizer) -> None:
    """Reload the folder with the Auto classes and check it reproduces the outputs."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for prompt, expected in zip(prompts[:3] + prompts[-2:], outputs[:3] + outputs[-2:]):
        assert greedy_decode(model, prompt)[0] == expected, folder
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.get_vocab() == tokenizer.get_vocab()
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (BOS_ID, EOS_ID)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def make_one(name: str, tokenizer, prompts) -> float:
    """Build, check, save and verify one fixture model; return its min margin."""
    folder = OUT_DIR / name
    model, seed, outputs, min_margin, min_router, logits = find_good_model(name, prompts)
    if folder.exists():
        shutil.rmtree(folder)  # no stale shards from an earlier run
    folder.mkdir(parents=True)
    save_checkpoint(name, model, tokenizer, folder)
    save_expected(folder, seed, prompts, outputs, min_margin, logits, min_router)
    verify_reload(folder, prompts, outputs, tokenizer)
    router = f", min router margin {min_router:.4f}" if min_router is not None else ""
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    print(
        f"{name}: seed {seed}, min margin {min_margin:.4f}{router}, {size / 1e3:.0f} KB"
        f" -> {folder.relative_to(REPO_ROOT)}"
    )
    return min_margin


def main(argv: list[str] | None = None) -> None:
    """Generate the named fixture checkpoints (default: every one in ``MODELS``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help=f"models to (re)generate, default all: {', '.join(MODELS)}",
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    names = list(dict.fromkeys(args.models)) or list(MODELS)

    torch.set_num_threads(1)  # thread count can change float reduction order
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    prompts = make_prompts()
    for name in names:
        make_one(name, tokenizer, prompts)
    size = sum(f.stat().st_size for f in OUT_DIR.rglob("*") if f.is_file())
    print(f"total fixture size: {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
