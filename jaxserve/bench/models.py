"""Hugging Face model folders for `jaxserve bench`: the bundled model, or seeded random-weight Llamas of named shapes.

A generated folder holds config.json, generation_config.json, a word-level tokenizer of the shape's vocabulary
("<s>", "</s>", "<unk>", "<pad>", then "t4", "t5", ...) and, for shapes under WEIGHTS_PARAM_LIMIT parameters,
model.safetensors written with numpy. Larger shapes (Llama-3.1-8B) get no weights file: jaxserve then runs them
with load_format="dummy" (random weights made on the device), and peers that need weights are skipped.
Folders are cached under --cache-dir, named by a fingerprint of everything that made them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable

import numpy as np

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")  # ids 0..3 of a generated tokenizer
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 0, 1, 2, 3
# Init of written weights: matrices N(0, LINEAR_GAIN^2 / fan_in), embeddings and lm_head N(0, EMBED_STD^2),
# norms 1 + N(0, NORM_STD^2). Larger-than-default stds make greedy logits "peaky", so float32 peers agree on argmax.
LINEAR_GAIN = 1.6
EMBED_STD = 0.3
NORM_STD = 0.1
WEIGHTS_PARAM_LIMIT = 1_000_000_000  # parameters; larger shapes get no weights file (load_format="dummy")
MODEL_FORMAT_VERSION = 2  # bump when the recipe changes: cached folders are rebuilt
DEFAULT_CACHE_DIR = "/tmp/jaxserve-bench"
FINGERPRINT_FILE = "bench_fingerprint.json"  # written last: its presence means the folder is complete


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters of a Llama checkpoint."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # extra rope_parameters, e.g. Llama 3.1's "llama3" scaling
    dtype: str = "float32"
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameters of the whole model."""
        hidden, head_dim = self.hidden_size, self.head_dim
        attention = hidden * head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)  # q, o, k, v
        mlp = 3 * hidden * self.intermediate_size  # gate, up, down
        per_layer = attention + mlp + 2 * hidden  # + two norms
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + hidden  # + final norm


BUNDLED = "bundled"  # the model shipped inside jaxserve: nothing generated
SHAPES: dict[str, LlamaShape] = {
    # A random-weight Llama of a larger shape than the bundled one (benchmarks/throughput.py's model).
    "llama-small": LlamaShape(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                              intermediate_size=1024, max_position_embeddings=1024),
    # llama-small with 4096 positions: long-context experiments (bench effects --effect preemption).
    "llama-small-4k": LlamaShape(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                                 intermediate_size=1024, max_position_embeddings=4096),
    # Llama-3.1-8B's published shape (random weights on the device: load_format="dummy").
    "llama-3.1-8b": LlamaShape(
        vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
        max_position_embeddings=131072, rope_theta=500000.0, dtype="bfloat16", rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
}
SHAPE_NAMES = (BUNDLED, *SHAPES)


def has_weights(shape: LlamaShape) -> bool:
    """Whether a generated folder of this shape gets a weights file (small enough to write with numpy)."""
    return shape.num_params < WEIGHTS_PARAM_LIMIT


def needs_dummy_weights(folder: str) -> bool:
    """True when the folder holds no *.safetensors: jaxserve must run it with load_format="dummy"."""
    return not any(name.endswith(".safetensors") for name in os.listdir(folder))


def model_fingerprint(shape: LlamaShape, seed: int) -> dict:
    """Everything that determines a generated folder's contents."""
    return {"shape": dataclasses.asdict(shape), "seed": seed, "weights": has_weights(shape), "gain": LINEAR_GAIN,
            "embed_std": EMBED_STD, "norm_std": NORM_STD, "special_tokens": list(SPECIAL_TOKENS),
            "version": MODEL_FORMAT_VERSION}


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer of `vocab_size` entries: "<s>", "</s>", "<unk>", "<pad>", "t4" ... "t{vocab_size-1}"
    (a transformers PreTrainedTokenizerFast; text is whitespace-split words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )


def hf_config(shape: LlamaShape) -> dict:
    """config.json of a LlamaForCausalLM of this shape (transformers 5 layout: rope_parameters)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": shape.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta, **(shape.rope_scaling or {})},
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": shape.tie_word_embeddings, "dtype": shape.dtype, "use_cache": True,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    }


def random_weights(shape: LlamaShape, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights under Hugging Face's LlamaForCausalLM names (Linear weights are (out, in))."""
    rng = np.random.default_rng(seed)
    hidden, inner, head_dim = shape.hidden_size, shape.intermediate_size, shape.head_dim

    def linear(out_features: int, in_features: int) -> np.ndarray:  # (out, in)
        noise = rng.standard_normal((out_features, in_features), dtype=np.float32)
        return noise * np.float32(LINEAR_GAIN / math.sqrt(in_features))

    def norm() -> np.ndarray:  # (hidden,)
        return 1.0 + NORM_STD * rng.standard_normal(hidden, dtype=np.float32)

    weights = {"model.embed_tokens.weight": EMBED_STD * rng.standard_normal((shape.vocab_size, hidden),
                                                                            dtype=np.float32)}
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}."
        weights.update({
            prefix + "input_layernorm.weight": norm(),
            prefix + "self_attn.q_proj.weight": linear(shape.num_heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": linear(shape.num_kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": linear(shape.num_kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": linear(hidden, shape.num_heads * head_dim),
            prefix + "post_attention_layernorm.weight": norm(),
            prefix + "mlp.gate_proj.weight": linear(inner, hidden),
            prefix + "mlp.up_proj.weight": linear(inner, hidden),
            prefix + "mlp.down_proj.weight": linear(hidden, inner),
        })
    weights["model.norm.weight"] = norm()
    if not shape.tie_word_embeddings:
        weights["lm_head.weight"] = EMBED_STD * rng.standard_normal((shape.vocab_size, hidden), dtype=np.float32)
    return weights


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def _write_folder(folder: str, shape: LlamaShape, seed: int) -> None:
    """Write every file of a generated model folder into `folder` (which exists)."""
    _write_json(os.path.join(folder, "config.json"), hf_config(shape))
    _write_json(os.path.join(folder, "generation_config.json"),
                {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
    build_tokenizer(shape.vocab_size).save_pretrained(folder)
    if has_weights(shape):
        if shape.dtype != "float32":
            raise ValueError(f"weights are written in float32 only; the shape's dtype is {shape.dtype}")
        from safetensors.numpy import save_file

        save_file(random_weights(shape, seed), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def ensure_model(shape_name: str, cache_dir: str, seed: int = 0,
                 log: Callable[[str], None] = lambda message: None) -> str:
    """The folder of a named shape: the bundled model's, or a generated one under `cache_dir` (built on first
    use, reused while its fingerprint matches)."""
    if shape_name == BUNDLED:
        from jaxserve.engine.llm_engine import default_model_path

        return default_model_path()
    if shape_name not in SHAPES:
        raise ValueError(f"unknown model shape {shape_name!r}; choose one of {', '.join(SHAPE_NAMES)}")
    shape = SHAPES[shape_name]
    what = (f"a random-weight {shape_name} ({shape.num_params / 1e6:.1f}M parameters"
            f"{'' if has_weights(shape) else ', no weights file: load_format dummy'})")
    return _cached_folder(cache_dir, shape_name, model_fingerprint(shape, seed), what,
                          lambda folder: _write_folder(folder, shape, seed), log)


def early_exit_copy(model: str, num_layers: int, cache_dir: str,
                    log: Callable[[str], None] = lambda message: None) -> str:
    """A draft model made from `model`: its first `num_layers` layers with its embeddings, final norm and
    head (an early exit), same tokenizer; written under `cache_dir` on first use."""
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    if not 1 <= num_layers < config["num_hidden_layers"]:
        raise ValueError(f"--spec-draft-layers must be in 1..{config['num_hidden_layers'] - 1}, got {num_layers}")
    files = sorted(os.listdir(model))
    fingerprint = {"source": os.path.abspath(model), "num_layers": num_layers,
                   "files": {name: os.path.getsize(os.path.join(model, name)) for name in files}}

    def write(folder: str) -> None:
        weights = {}
        for name in files:
            path = os.path.join(model, name)
            if name.endswith(".safetensors"):
                weights.update({key: value for key, value in load_file(path).items()
                                if not key.startswith("model.layers.") or int(key.split(".")[2]) < num_layers})
            elif os.path.isfile(path) and not name.endswith(".index.json") and name != "config.json":
                shutil.copy(path, folder)
        save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        _write_json(os.path.join(folder, "config.json"), {**config, "num_hidden_layers": num_layers})

    name = f"{os.path.basename(os.path.normpath(model))}-first-{num_layers}-layers"
    return _cached_folder(cache_dir, name, fingerprint, f"the first {num_layers} layers of {model}", write, log)


def _cached_folder(cache_dir: str, name: str, fingerprint: dict, what: str, write: Callable[[str], None],
                   log: Callable[[str], None]) -> str:
    """`cache_dir/name-<digest of fingerprint>`, written by `write(folder)` unless a complete one is there."""
    digest = hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:10]
    folder = os.path.join(cache_dir, f"{name}-{digest}")
    if os.path.isfile(os.path.join(folder, FINGERPRINT_FILE)):
        log(f"reusing model folder {folder}")
        return folder
    log(f"writing {what} to {folder}")
    building = f"{folder}.building-{os.getpid()}"  # renamed into place when complete
    shutil.rmtree(building, ignore_errors=True)
    os.makedirs(building)
    write(building)
    _write_json(os.path.join(building, FINGERPRINT_FILE), fingerprint)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder left by an interrupted build
    os.rename(building, folder)
    return folder


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the model options (an argument group): --model-shape or --model, --cache-dir, --model-seed,
    --load-format."""
    group = parser.add_argument_group("model")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--model-shape", choices=SHAPE_NAMES, default=BUNDLED,
                        help="bundled: the model shipped with jaxserve; llama-small: a random-weight Llama (4 layers, "
                             "hidden 256, 8/2 heads, vocab 4096, float32, 1024 positions); llama-small-4k: the same "
                             "with 4096 positions; llama-3.1-8b: Llama-3.1-8B's shape with "
                             "random weights made on the device (default: %(default)s)")
    choice.add_argument("--model", metavar="PATH", help="benchmark this Hugging Face folder instead of a named shape")
    group.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                       help="generated model folders (and converted peers' copies) live here (default: %(default)s)")
    group.add_argument("--model-seed", type=int, default=0, help="seed of generated weights (default: %(default)s)")
    group.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                       help="jaxserve's weights: auto (the folder's) or dummy (random, made on the device); default: "
                            "dummy when the folder has no *.safetensors, else auto")


def model_from_args(args: argparse.Namespace, log: Callable[[str], None] = lambda message: None) -> str:
    """The model folder the options of add_model_arguments name (generated if needed); also resolves
    `args.load_format` when it was left unset (dummy exactly when the folder has no weights file)."""
    if args.model is not None:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise ValueError(f"--model {args.model!r} is not a Hugging Face folder (no config.json)")
        folder = args.model
    else:
        folder = ensure_model(args.model_shape, args.cache_dir, args.model_seed, log)
    if args.load_format is None:
        args.load_format = "dummy" if needs_dummy_weights(folder) else "auto"
    return folder
