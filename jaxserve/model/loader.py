"""Load a Hugging Face Llama-family folder's safetensors (or the same tensors in memory, by name) straight into
sharded, stacked params; or load them anew into the params being served (`into`, a weight update).

A quantized checkpoint's tensors are read through views (`tensor_source`): compressed-tensors' packed int4 as bytes
(`PackedInt4`), AutoAWQ's and GPTQ's forms as compressed-tensors' (`AwqGemm`, `GptqPacked`), which the params keep
quantized; and gpt-oss's MXFP4 experts (`_blocks` and `_scales`, quant_method mxfp4), which `Mxfp4Experts`
dequantizes as they load, each device reading its part, into float params like any other checkpoint's."""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors import safe_open

from jaxserve.model.quantize import INT4_PER_BYTE, WEIGHT_DTYPES, quantized_spec
from jaxserve.model.registry import Weight, map_weights, map_weights_with, model_for
from jaxserve.model_spec import ModelSpec

# The fp8 KV cache's scales (attention/fp8.py): params leaf -> HF name template (vLLM's names; a scalar or one per
# KV head)
_KV_SCALES = {"k_scale": "model.layers.{i}.self_attn.k_scale", "v_scale": "model.layers.{i}.self_attn.v_scale"}


def resolve_dtype(dtype: str, spec: ModelSpec) -> jnp.dtype:
    """'auto' takes the checkpoint's dtype."""
    name = spec.torch_dtype.replace("torch.", "") if dtype == "auto" else dtype
    return jnp.dtype({"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(name, jnp.float32))


# A new stacked leaf whose shard on a device is at most this is read into host memory whole and put on the devices
# in one piece; larger ones are put layer by layer into a stack on the devices, so the host holds one layer's shard
# at a time. The pieces are what a model's norms, biases and scales and the weights of a small model take: the
# layer-by-layer way compiles two programs per shape (the stack's zeros and the update), ~0.1 s each on a CPU.
HOST_STACKED_BYTES = 16 * 2**20

# safetensors dtypes its numpy reader cannot make (numpy has no float8), read by mapping the file instead.
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}


def _safetensors_header(path: str) -> tuple[int, dict]:
    """(the byte offset of a safetensors file's data, its header: name -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        return 8 + length, json.loads(f.read(length))


class SafetensorsFolder:
    """Name -> tensor access over one or several safetensors files of a folder."""

    def __init__(self, path: str):
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            if not os.path.isdir(path):
                raise ValueError(f"model folder {path!r} does not exist")
            raise ValueError(f"no *.safetensors weights in model folder {path!r}")
        self._location: dict[str, str] = {}
        self._raw: dict[str, tuple[str, int, tuple[int, ...], np.dtype]] = {}  # float8 tensors: file, offset, shape
        for file in files:
            full = os.path.join(path, file)
            if not os.path.isfile(full):
                raise ValueError(f"model folder {path!r} is missing weight file {file!r} named in its index")
            data_start, header = _safetensors_header(full)
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                self._location[name] = full
                if entry["dtype"] in RAW_DTYPES:
                    offset = data_start + entry["data_offsets"][0]
                    self._raw[name] = (full, offset, tuple(entry["shape"]), RAW_DTYPES[entry["dtype"]])

    def __contains__(self, name: str) -> bool:
        return name in self._location

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or only its `index` part (read from the file alone), as a host numpy array
        (bfloat16 via ml_dtypes)."""
        if name not in self._location:
            raise ValueError(f"weight {name!r} not found in the checkpoint")
        if name in self._raw:  # mapped from the file: only the part indexed is read
            path, offset, shape, dtype = self._raw[name]
            tensor = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
            return np.array(tensor if index is None else tensor[index])
        with safe_open(self._location[name], framework="numpy") as f:  # numpy: no copy through a jax array
            return f.get_tensor(name) if index is None else f.get_slice(name)[index]

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without reading it."""
        if name not in self._location:
            raise ValueError(f"weight {name!r} not found in the checkpoint")
        if name in self._raw:
            return self._raw[name][2]
        with safe_open(self._location[name], framework="flax") as f:
            return tuple(f.get_slice(name).get_shape())


class TensorMapping:
    """Name -> tensor access over arrays in memory (numpy or JAX, by their Hugging Face names), as
    SafetensorsFolder gives over files."""

    def __init__(self, tensors: Mapping[str, object]):
        self._tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or only its `index` part, as a host numpy array."""
        if name not in self._tensors:
            raise ValueError(f"weight {name!r} not found in the weights given")
        tensor = self._tensors[name]
        return np.asarray(tensor if index is None else tensor[index])

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        if name not in self._tensors:
            raise ValueError(f"weight {name!r} not found in the weights given")
        return tuple(self._tensors[name].shape)


class PackedInt4:
    """A view of a compressed-tensors pack-quantized checkpoint (or of its arrays) in which a linear weight's name,
    `X.weight`, reads `X.weight_packed` as bytes: int32 (out, in / 8), eight 4-bit values to a word from the lowest
    bits up, each stored plus 8, is read as uint8 (out, in / 2), input columns 2j and 2j + 1 in byte j's low and
    high nibble (model/quantize.py keeps int4 weights so). Every other name reads as stored."""

    def __init__(self, source: "SafetensorsFolder | TensorMapping"):
        self.source = source

    def _packed(self, name: str) -> str | None:
        """The packed tensor `name` reads, or None for a name read as stored."""
        if name in self.source or not name.endswith(".weight"):
            return None
        return name + "_packed" if name + "_packed" in self.source else None

    def __contains__(self, name: str) -> bool:
        return name in self.source or self._packed(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape; a packed weight's (out, in / 2) bytes."""
        if self._packed(name) is None:
            return self.source.shape(name)
        out, columns = (int(size) for size in self.source.get(name + "_shape").reshape(-1))
        if columns % 8:
            raise ValueError(f"{name} has {columns} input columns, not a multiple of 8 (whole int32 words)")
        return out, columns // 2

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or only its `index` part; a packed weight's bytes, reading only the words that hold them."""
        packed = self._packed(name)
        if packed is None:
            return self.source.get(name, index)
        rows, columns = index or (slice(None), slice(None))
        start, stop = columns.indices(self.shape(name)[1])[:2]
        first, last = start // 4, -(-stop // 4)  # the words holding bytes start..stop
        words = np.ascontiguousarray(self.source.get(packed, (rows, slice(first, last))), dtype="<i4")  # (r, w)
        return words.view(np.uint8)[:, start - 4 * first: stop - 4 * first]  # (r, stop - start) little-endian


class _PackedView:
    """A view of a checkpoint whose linear layers are quantized in another library's tensors (`PARTS`: the
    compressed-tensors tensor of a module X (`X.weight_packed`, or `X.weight` for 8 bits: `weight_part`;
    `X.weight_scale`, `X.weight_zero_point`, `X.weight_shape`) -> the module's own tensor it is read from) as
    compressed-tensors' form, which `PackedInt4` then reads for 4 bits. Every other name reads as stored."""

    PARTS: dict[str, str] = {}
    weight_part = ".weight_packed"

    def __init__(self, source: "SafetensorsFolder | TensorMapping"):
        self.source = source

    def _module(self, name: str, part: str) -> str | None:
        """The module whose tensor `name` reads when it is the module's `part` and the checkpoint has that
        tensor, else None."""
        module = name.removesuffix(part)
        return module if module != name and module + self.PARTS[part] in self.source else None

    def __contains__(self, name: str) -> bool:
        return name in self.source or any(self._module(name, part) for part in self.PARTS)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape: a weight's as compressed-tensors stores it (4 bits: packed words (out, in / 8))."""
        module = self._module(name, self.weight_part)
        if module is not None:
            return self._weight_shape(module)
        return self.get(name).shape if any(self._module(name, part) for part in self.PARTS) \
            else self.source.shape(name)

    def _weight_shape(self, module: str) -> tuple[int, int]:
        """A module's weight as compressed-tensors stores it."""
        raise NotImplementedError


class AwqGemm(_PackedView):
    """A view of an AutoAWQ GEMM checkpoint (or of its arrays) as a compressed-tensors asymmetric one, which
    `PackedInt4` then reads: a linear layer X's `X.qweight` int32 (in, out / 8), `X.qzeros` int32 (groups, out / 8)
    (eight 4-bit unsigned values to a word along the outputs, in AWQ's order: output column AWQ_ORDER[k] of each
    eight in bits 4k..4k + 3) and `X.scales` (groups, out) read as `X.weight_packed` bytes, `X.weight_scale`
    (out, groups) and `X.weight_zero_point` words (out / 8, groups) packed along the outputs in order. An unsigned
    value u is the signed q = u - 8 stored plus 8, so (u - zero) * scale is (q - (zero - 8)) * scale: the same
    nibbles serve. Every other name reads as stored."""

    PARTS = {".weight_packed": ".qweight", ".weight_scale": ".scales", ".weight_zero_point": ".qzeros",
             ".weight_shape": ".qweight"}

    def _weight_shape(self, module: str) -> tuple[int, int]:
        rows, words = self.source.shape(module + ".qweight")
        return words * 8, rows // 8

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or only its `index` part (of a weight's packed words: only the AWQ words that hold it)."""
        if (module := self._module(name, ".weight_packed")) is not None:
            out, words = self.shape(name)
            rows, columns = index or (slice(None), slice(None))
            (first, last), (start, stop) = rows.indices(out)[:2], columns.indices(words)[:2]
            stored = self.source.get(module + ".qweight", (slice(8 * start, 8 * stop), slice(first // 8,
                                                                                           -(-last // 8))))
            values = _awq_columns(stored)[:, first - 8 * (first // 8): last - 8 * (first // 8)]  # (in, out)
            return pack_int4_rows(values.T)  # (out, in / 8) words
        if (module := self._module(name, ".weight_scale")) is not None:
            return self.source.get(module + ".scales").astype(np.float32).T  # (out, groups)
        if (module := self._module(name, ".weight_zero_point")) is not None:
            return pack_int4_rows(_awq_columns(self.source.get(module + ".qzeros"))).T  # (out / 8, groups)
        if (module := self._module(name, ".weight_shape")) is not None:
            return np.array(self._weight_shape(module), np.int64) * (1, 8)
        return self.source.get(name, index)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's word: bits 4k..4k + 3 hold output column AWQ_ORDER[k] of its eight


class GptqPacked(_PackedView):
    """A view of a GPTQ checkpoint (AutoGPTQ's and GPTQModel's "gptq" format) as a compressed-tensors one. A linear
    layer X's `X.qweight` int32 (in * bits / 32, out) holds unsigned values packed along the inputs from the lowest
    bits up: with 4 bits it is read as `X.weight_packed` (out, in / 8) (its transpose: an unsigned value u is the
    signed q = u - 8 stored plus 8, so the words carry over), with 8 bits as `X.weight` int8 (out, in), u - 128.
    `X.scales` (groups, out) reads as `X.weight_scale` (out, groups), `X.qzeros` int32 (groups, out / 8) (4 bits,
    packed along the outputs) as `X.weight_zero_point` words (out / 8, groups). GPTQ stores each zero point less one
    (a zero point 0 wraps to 15, which GPTQ's kernels read as 16): the loader adds it back
    (`GPTQ_ZERO_STORED_LESS`). Under act-order `X.g_idx` (in,), each input row's group, reads as `X.weight_g_idx`;
    without it a weight is read only when its `g_idx` (if stored) puts input row i in group i // group size. A
    `symmetric` checkpoint's weight is read only when every zero point is 2 ** (bits - 1), which the served weight
    leaves out."""

    def __init__(self, source: "SafetensorsFolder | TensorMapping", bits: int, symmetric: bool,
                 act_order: bool = False):
        super().__init__(source)
        self.bits, self.symmetric, self.act_order = bits, symmetric, act_order
        self.per_word = 32 // bits
        self.weight_part = ".weight_packed" if bits == 4 else ".weight"
        self.PARTS = {self.weight_part: ".qweight", ".weight_scale": ".scales", ".weight_zero_point": ".qzeros",
                      ".weight_shape": ".qweight", ".weight_g_idx": ".g_idx"}
        self._checked: set[str] = set()  # modules whose g_idx and zero points were checked

    def _weight_shape(self, module: str) -> tuple[int, int]:
        words, out = self.source.shape(module + ".qweight")
        return (out, words) if self.bits == 4 else (out, words * self.per_word)

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or only its `index` part (of a weight: only the words that hold it)."""
        if (module := self._module(name, self.weight_part)) is not None:
            self._check(module)
            rows, columns = index or (slice(None), slice(None))
            if self.bits == 4:
                return np.ascontiguousarray(self.source.get(module + ".qweight", (columns, rows)).T)  # (out, in / 8)
            start, stop = columns.indices(self._weight_shape(module)[1])[:2]
            first = start // 4
            words = self.source.get(module + ".qweight", (slice(first, -(-stop // 4)), rows))  # (w, out)
            values = _unsigned_values(words.T, 8)[:, start - 4 * first: stop - 4 * first]  # (out, stop - start)
            return (values.astype(np.int16) - 128).astype(np.int8)
        if (module := self._module(name, ".weight_scale")) is not None:
            return self.source.get(module + ".scales").astype(np.float32).T  # (out, groups)
        if (module := self._module(name, ".weight_zero_point")) is not None:
            return np.ascontiguousarray(self.source.get(module + ".qzeros").T)  # (out / 8, groups)
        if (module := self._module(name, ".weight_shape")) is not None:
            out, stored = self._weight_shape(module)
            return np.array((out, stored * (8 if self.bits == 4 else 1)), np.int64)
        if (module := self._module(name, ".weight_g_idx")) is not None:
            return self.source.get(module + ".g_idx", index)
        return self.source.get(name, index)

    def _check(self, module: str) -> None:
        """ValueError unless the module's groups are consecutive input rows (or the checkpoint is act-order) and,
        when symmetric, its zero points are all 2 ** (bits - 1)."""
        if module in self._checked:
            return
        words, out = self.source.shape(module + ".qweight")
        groups = self.source.shape(module + ".scales")[0]
        rows = words * self.per_word
        if module + ".g_idx" in self.source and not self.act_order:
            order = self.source.get(module + ".g_idx").astype(np.int64)  # (in,)
            if not np.array_equal(order, np.arange(rows) * groups // rows):
                raise ValueError(f"{module}.g_idx does not put input row i in group i // group_size, as a checkpoint "
                                 "whose quantization_config has desc_act false (or static_groups) must: say "
                                 "desc_act true if it was quantized with act-order")
        if self.symmetric:
            middle = 2 ** (self.bits - 1)
            stored = _unsigned_values(self.source.get(module + ".qzeros"), self.bits)  # (groups, out)
            if not np.all(stored == middle - GPTQ_ZERO_STORED_LESS):
                raise ValueError(f"{module}.qzeros holds zero points other than {middle} but the checkpoint says "
                                 "sym true")
        self._checked.add(module)


class FusedRows:
    """A view in which the parts of a fused projection read as the separate tensors the model declares: a name
    `P.S.weight` whose module suffix S is in `parts` ({S: (fused suffix F, first row, rows)}) reads rows
    first..first + rows of `P.F.weight` (Phi-3's q/k/v of `qkv_proj`, gate/up of `gate_up_proj`; only the
    rows a shard needs). Every other name reads as stored."""

    def __init__(self, source: "SafetensorsFolder | TensorMapping", parts: dict[str, tuple[str, int, int]]):
        self.source = source
        self.parts = parts

    def _fused(self, name: str) -> tuple[str, int, int] | None:
        """(the fused tensor, first row, rows) that `name` reads, or None for a name read as stored."""
        if name in self.source:
            return None
        module, _, tensor = name.rpartition(".")
        for suffix, (fused, first, rows) in self.parts.items():
            if module.endswith("." + suffix):
                return f"{module.removesuffix(suffix)}{fused}.{tensor}", first, rows
        return None

    def __contains__(self, name: str) -> bool:
        fused = self._fused(name)
        return name in self.source if fused is None else fused[0] in self.source

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape; a part's (its rows, the fused tensor's other axes)."""
        fused = self._fused(name)
        if fused is None:
            return self.source.shape(name)
        return fused[2], *self.source.shape(fused[0])[1:]

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or only its `index` part; a part's rows read from the fused tensor."""
        fused = self._fused(name)
        if fused is None:
            return self.source.get(name, index)
        fused_name, first, rows = fused
        row_index, *rest = index or (slice(None),)
        start, stop = row_index.indices(rows)[:2]
        return self.source.get(fused_name, (slice(first + start, first + stop), *rest))


# MXFP4 (the OCP Microscaling format's FP4, gpt-oss's experts): an e2m1 code (sign bit 8) -> its value
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
MXFP4_BLOCK = 32  # values to a scale: 16 bytes, two codes to a byte, the first in the low nibble
E8M0_BIAS = 127  # a block's scale byte s stands for 2 ** (s - 127)
# a byte -> its two values, float32 side by side in one 64-bit word (one gather per byte)
_FP4_PAIRS = np.ascontiguousarray(np.stack([FP4_VALUES[np.arange(256) & 0xF], FP4_VALUES[np.arange(256) >> 4]],
                                           axis=1)).view(np.uint64)[:, 0]


class Mxfp4Experts:
    """A view of an MXFP4 checkpoint (gpt-oss's release, openai/gpt-oss-20b and -120b: quant_method "mxfp4") in
    which a tensor X that the checkpoint stores as `X_blocks` uint8 (E, out, in / 32, 16) and `X_scales` uint8
    (E, out, in / 32) reads as transformers dequantizes it (integrations/mxfp4.py's `convert_moe_packed_tensors`):
    (E, in, out), its input j of output row o the FP4 e2m1 code (FP4_VALUES) in byte (j % 32) // 2 of block j // 32
    of row o (the low nibble for even j, the high for odd) times 2 ** (the block's scale - 127) (E8M0). Only the
    experts, output rows and blocks of 32 inputs that the index covers are read (a tensor-parallel shard's columns
    of gate_up_proj, its rows of down_proj), each expert's apart (a few at once, on threads). The values come back
    bfloat16, which holds every MXFP4 value exactly (two significant bits under a power-of-two scale within its
    exponent range), for the loader to cast to the served dtype. Every other name reads as stored, so a BF16 copy
    of the experts (or new weights given by name) reads as it is."""

    def __init__(self, source: "SafetensorsFolder | TensorMapping"):
        self.source = source

    def _mxfp4(self, name: str) -> bool:
        """Whether `name` is read from its `_blocks` and `_scales` (the checkpoint lacks it but has either)."""
        return name not in self.source and (name + "_blocks" in self.source or name + "_scales" in self.source)

    def __contains__(self, name: str) -> bool:
        return name in self.source or self._mxfp4(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape; an MXFP4 one's dequantized (E, in, out), its blocks and scales checked to agree."""
        if not self._mxfp4(name):
            return self.source.shape(name)
        for part, other in (("_blocks", "_scales"), ("_scales", "_blocks")):
            if name + part not in self.source:
                raise ValueError(f"MXFP4 weight {name}: the checkpoint has {name + other} but not {name + part}")
        blocks, scales = self.source.shape(name + "_blocks"), self.source.shape(name + "_scales")
        if len(blocks) != 4 or blocks[-1] != MXFP4_BLOCK // 2 or tuple(scales) != tuple(blocks[:-1]):
            raise ValueError(f"MXFP4 weight {name}: {name}_blocks has shape {tuple(blocks)} and {name}_scales "
                             f"{tuple(scales)}, where (experts, out, in / {MXFP4_BLOCK}, {MXFP4_BLOCK // 2}) bytes and "
                             f"(experts, out, in / {MXFP4_BLOCK}) scales are needed")
        experts, out, groups, _ = blocks
        return experts, groups * MXFP4_BLOCK, out

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or only its `index` part; an MXFP4 one dequantized (E, in, out) bfloat16 from the bytes and
        scales of the experts, output rows and input blocks the index covers (the experts on a few threads)."""
        if not self._mxfp4(name):
            return self.source.get(name, index)
        shape = self.shape(name)
        experts, inputs, outputs = (*(index or ()), slice(None), slice(None), slice(None))[:3]
        selected, columns = range(*experts.indices(shape[0])), range(*inputs.indices(shape[1]))
        out = np.empty((len(selected), len(columns), len(range(*outputs.indices(shape[2])))), ml_dtypes.bfloat16)
        if out.size == 0:
            return out
        first, last = min(columns) // MXFP4_BLOCK, -(-(max(columns) + 1) // MXFP4_BLOCK)  # the blocks holding them
        offset = MXFP4_BLOCK * first
        within = slice(columns.start - offset, columns.stop - offset) if columns.step == 1 else \
            np.asarray(columns) - offset  # the inputs asked for among the blocks'

        def dequantize(position: int, expert: int) -> None:
            where = (slice(expert, expert + 1), outputs, slice(first, last))
            blocks = self.source.get(name + "_blocks", (*where, slice(None)))[0]  # (rows, blocks, 16)
            scales = self.source.get(name + "_scales", where)[0]  # (rows, blocks)
            for part, array in (("_blocks", blocks), ("_scales", scales)):
                if array.dtype != np.uint8:
                    raise ValueError(f"MXFP4 weight {name}: {name + part} is {array.dtype}, not uint8")
            values = _FP4_PAIRS[blocks].view(np.float32)  # (rows, blocks, 32)
            with np.errstate(over="ignore", invalid="ignore"):  # a scale byte of 255 overflows, as transformers'
                values *= np.ldexp(np.float32(1), scales.astype(np.int32) - E8M0_BIAS)[..., None]
            out[position] = values.reshape(len(values), -1)[:, within].T  # (inputs, rows)

        with ThreadPoolExecutor(min(len(selected), os.cpu_count() or 1, 8)) as pool:
            list(pool.map(dequantize, range(len(selected)), selected))
        return out


def _unsigned_values(words: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned `bits`-bit values (rows, words * 32 / bits) packed from the lowest bits up in int32 words (rows,
    words)."""
    if bits == 4:
        return unpack_int4_rows(words)
    return np.ascontiguousarray(words, dtype="<i4").view(np.uint8)  # (rows, 4 * words): byte k of a word is value k


GPTQ_ZERO_STORED_LESS = 1  # the "gptq" format stores zero point z as z - 1 (in 4 bits: 0 as 15, read as 16)


def _awq_columns(words: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit values (rows, 8 * words) of AWQ words (rows, words), in column order."""
    rows, count = words.shape
    in_bit_order = unpack_int4_rows(words).reshape(rows, count, 8)  # (rows, words, 8)
    return in_bit_order[:, :, np.argsort(AWQ_ORDER)].reshape(rows, -1)


def pack_int4_rows(values: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit values (rows, columns) packed eight columns to an int32 (rows, columns / 8), the first in the
    lowest bits (compressed-tensors' packing of signed values stored plus 8)."""
    rows, columns = values.shape
    nibbles = values.astype(np.uint32).reshape(rows, columns // 8, 8) << (4 * np.arange(8, dtype=np.uint32))
    return np.bitwise_or.reduce(nibbles, axis=2).view(np.int32)


def unpack_int4_rows(words: np.ndarray) -> np.ndarray:
    """`pack_int4_rows`'s inverse: unsigned 4-bit values (rows, 8 * words) of int32 words (rows, words)."""
    nibbles = (np.asarray(words, "<i4")[:, :, None] >> (4 * np.arange(8))) & 0xF  # (rows, words, 8)
    return nibbles.reshape(words.shape[0], -1)


TensorSource = SafetensorsFolder | TensorMapping | FusedRows | PackedInt4 | AwqGemm | GptqPacked | Mxfp4Experts


def tensor_source(source: str | TensorSource, spec: ModelSpec) -> TensorSource:
    """The tensors of a checkpoint folder or of arrays by name, as the served model reads them (an int4
    checkpoint's packed weights as bytes, `PackedInt4`, over an AWQ or GPTQ one's as compressed-tensors', `AwqGemm`,
    `GptqPacked`, which also reads 8-bit GPTQ weights as int8; a fused projection's parts apart, `FusedRows`; an
    MXFP4 checkpoint's experts dequantized, `Mxfp4Experts`)."""
    source = SafetensorsFolder(source) if isinstance(source, str) else source
    if spec.checkpoint_format == "mxfp4":
        source = Mxfp4Experts(source)
    fused = model_for(spec.architecture).fused_parts(spec)
    if fused:
        source = FusedRows(source, fused)
    if spec.checkpoint_format == "awq":
        source = AwqGemm(source)
    elif spec.checkpoint_format == "gptq":
        source = GptqPacked(source, 4 if spec.checkpoint_quantization == "int4" else 8,
                            symmetric=not spec.checkpoint_zero_points, act_order=spec.checkpoint_act_order)
    return PackedInt4(source) if spec.checkpoint_quantization == "int4" else source


def load_params(source: str | TensorSource, spec: ModelSpec, mesh: Mesh, dtype: jnp.dtype, num_cache_kv_heads: int,
                into: dict | None = None, declared: dict | None = None) -> dict:
    """Read every weight the model declares (model/registry.py) straight into its final sharding: each device's
    shard of each layer is read from the safetensors slice it needs and written into its place in the stacked
    leaf on the device, so the host holds about one layer's shard at a time, never a whole stacked leaf (but the
    small ones, of at most HOST_STACKED_BYTES a device: read whole, to compile no program for them).

    With `into` (params of the same model being served), each stacked leaf it holds is written over in place (it
    is donated: the devices hold the weights once plus one layer); the leaves it lacks are made anew. `declared`:
    the weights to read, when not the registered architecture's (an EAGLE head's, model/eagle.py)."""
    declared = declared or model_for(spec.architecture).weights(spec, num_cache_kv_heads, mesh.devices.size)
    check_source(source, spec, num_cache_kv_heads, mesh.devices.size, declared)  # each tensor there, in its shape
    folder = tensor_source(source, spec)
    kv_repeat = num_cache_kv_heads // spec.num_kv_heads

    def load(name: str, weight: Weight, current: jax.Array | dict | None) -> jax.Array | dict:
        layout = _Layout(weight.transpose, kv_repeat if weight.kv_heads else 1, spec.head_dim)
        sharding = NamedSharding(mesh, weight.spec)
        if not weight.per_layer:
            return _load_one(folder, weight.hf_name, layout, sharding, dtype)
        names = [weight.layer_names(i) for i in range(weight.shape[0])]
        if spec.checkpoint_quantization != "none" and weight.quantizable:
            return _load_quantized(folder, names, layout, sharding, spec, current)
        return _load_stacked(folder, names, layout, sharding, dtype, current)

    return map_weights_with(load, declared, into or {})


def check_source(source: str | TensorSource, spec: ModelSpec, num_cache_kv_heads: int, num_devices: int,
                 declared: dict | None = None) -> None:
    """ValueError naming the first tensor the model declares (or `declared`, an EAGLE head's) that `source` lacks or
    holds in another shape (a quantized checkpoint's scales too), before anything is read."""
    source = tensor_source(source, spec)
    kv_repeat = num_cache_kv_heads // spec.num_kv_heads
    declared = declared or model_for(spec.architecture).weights(spec, num_cache_kv_heads, num_devices)

    def check(_: str, weight: Weight) -> None:
        layout = _Layout(weight.transpose, kv_repeat if weight.kv_heads else 1, spec.head_dim)
        if not weight.per_layer:
            named = [(weight.hf_name, weight.shape)]
        else:
            per_layer = [weight.layer_names(i) for i in range(weight.shape[0])]
            expert = "{j}" in weight.hf_name
            named = [(name, weight.shape[2 if expert else 1:]) for names in per_layer
                     for name in (names if expert else [names])]
        if spec.checkpoint_quantization == "int4" and weight.quantizable:  # two to a byte along the inputs
            named = [(name, (*shape[:-2], shape[-2] // INT4_PER_BYTE, shape[-1])) for name, shape in named]
        for name, shape in named:
            if name not in source:
                raise ValueError(f"weight {name!r} is missing")
            if layout.shape(source.shape(name)) != tuple(shape):
                raise ValueError(f"weight {name!r} has shape {source.shape(name)}, which does not fit the served "
                                 f"model (it needs {tuple(shape)}{' transposed' if layout.transpose else ''})")
            scale_name = name + spec.checkpoint_scale_suffix
            if spec.checkpoint_quantization != "none" and weight.quantizable and scale_name not in source:
                raise ValueError(f"weight {scale_name!r} (the {spec.checkpoint_quantization} checkpoint's scale) is "
                                 "missing")

    map_weights(check, declared)


def load_kv_scales(path: str, spec: ModelSpec, num_cache_kv_heads: int) -> dict | None:
    """{"k_scale", "v_scale": (L, cache KV heads) float32} from the checkpoint's per-layer `self_attn.k_scale` and
    `v_scale` (one value, or one per KV head; repeated like the KV heads), or None when it has none."""
    folder = SafetensorsFolder(path)
    if _KV_SCALES["k_scale"].format(i=0) not in folder:
        return None
    kv_repeat = num_cache_kv_heads // spec.num_kv_heads
    scales = {}
    for leaf, template in _KV_SCALES.items():
        rows = []
        for i in range(spec.num_layers):
            stored = folder.get(template.format(i=i)).astype(np.float32).reshape(-1)  # (1,) or (Hkv,)
            if stored.size not in (1, spec.num_kv_heads) or not np.all(np.isfinite(stored) & (stored > 0)):
                raise ValueError(f"{template.format(i=i)} must hold one positive scale or one per KV head "
                                 f"({spec.num_kv_heads}), got {stored.tolist()}")
            rows.append(np.repeat(np.broadcast_to(stored, (spec.num_kv_heads,)), kv_repeat))
        scales[leaf] = np.stack(rows)  # (L, cache KV heads)
    return scales


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a params leaf's per-layer array relates to its checkpoint tensor: transposed (a Linear
    weight, (out, in) -> (in, out)), and/or each KV head repeated `kv_repeat` times along the last axis
    (vLLM's layout when the TP size exceeds the KV heads)."""

    transpose: bool
    kv_repeat: int
    head_dim: int

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The params array's shape for a checkpoint tensor of shape `stored`."""
        shape = list(stored[::-1] if self.transpose else stored)
        shape[-1] *= self.kv_repeat
        return tuple(shape)

    def read(self, folder: TensorSource, name: str, index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
        """The part `index` (of the params array of `shape`) of tensor `name`, reading only what it needs."""
        bounds = [part.indices(size)[:2] for part, size in zip(index, shape)]  # [(start, stop)] per axis
        columns = np.arange(*bounds[-1])  # params columns -> checkpoint columns (KV heads repeated)
        group = self.kv_repeat * self.head_dim
        source = (columns // group) * self.head_dim + columns % self.head_dim if self.kv_repeat > 1 else columns
        first, last = int(source[0]), int(source[-1]) + 1  # source is non-decreasing
        wanted = [slice(*b) for b in bounds[:-1]] + [slice(first, last)]
        part = folder.get(name, tuple(wanted[::-1]) if self.transpose else tuple(wanted))
        part = part.T if self.transpose else part
        return part[..., source - first] if self.kv_repeat > 1 else part


def _load_one(folder: TensorSource, name: str | list, layout: _Layout, sharding, dtype,
              shape: tuple[int, ...] | None = None) -> jax.Array:
    """One array of `shape` (needed for a list; else the checkpoint tensor's): an unstacked leaf, a layer, or a list
    stacked as `_read_slice` reads it (a layer's experts, a small stacked leaf's layers), each device's shard read
    from its slices of the checkpoint tensors."""
    shape = shape or layout.shape(folder.shape(name))
    return jax.make_array_from_callback(shape, sharding,
                                        lambda index: _read_slice(folder, name, layout, dtype, shape, index))


def _load_quantized(folder: TensorSource, names: list[str], layout: _Layout, sharding, spec: ModelSpec,
                    into: dict | None = None) -> dict:
    """A quantized leaf (model/quantize.py) from an fp8 or int4 checkpoint's weights and their scales (one per
    output channel, (out, 1), or per tensor; or grouped, one per block of `spec.checkpoint_weight_block`) and zero
    points (asymmetric int4 groups), KV heads repeated like the weights, a layer's experts (a list of names)
    stacked, each stack filled one layer at a time; written over `into`'s when given."""
    into = into or {}
    dtype = WEIGHT_DTYPES[spec.checkpoint_quantization]
    weight = _load_stacked(folder, names, layout, sharding, dtype, into.get("weight"))
    block = spec.checkpoint_weight_block
    specs = quantized_spec(sharding.spec, grouped=block is not None, row_groups=spec.checkpoint_act_order)
    spec_of_scale = specs["scale"]
    scales = _PerWeight(folder, spec, _block_scale if block else _channel_scale, spec.checkpoint_scale_suffix)
    if block and not spec.checkpoint_act_order:  # the groups axis of (L, [E,] groups, out)
        first = names[0][0] if isinstance(names[0], list) else names[0]
        group_axis = weight.ndim - 2
        _check_groups_split_evenly(first, scales.shape(first)[0], block, sharding.mesh,
                                   spec_of_scale[group_axis] if group_axis < len(spec_of_scale) else None)
    scale_layout = _Layout(False, layout.kv_repeat, layout.head_dim)  # KV heads' channels repeated as the weight's
    scale_sharding = NamedSharding(sharding.mesh, spec_of_scale)
    leaf = {"weight": weight, "scale": _load_stacked(scales, names, scale_layout, scale_sharding, jnp.float32,
                                                     into.get("scale"))}
    if spec.checkpoint_zero_points:  # shaped and split like the grouped scales
        stored_less = GPTQ_ZERO_STORED_LESS if spec.checkpoint_format == "gptq" else 0
        zeros = _PerWeight(folder, spec, functools.partial(_group_zero_points, stored_less=stored_less), "_zero_point")
        leaf["zero"] = _load_stacked(zeros, names, scale_layout, scale_sharding, jnp.int8, into.get("zero"))
    if spec.checkpoint_act_order:  # each input row's group, split like the rows
        groups = _PerWeight(folder, spec, _row_groups, "_g_idx")
        leaf["row_groups"] = _load_stacked(groups, names, _Layout(False, 1, layout.head_dim),
                                           NamedSharding(sharding.mesh, specs["row_groups"]), jnp.int32,
                                           into.get("row_groups"))
    return leaf


class _PerWeight:
    """What a quantized checkpoint stores beside each weight (its scales, or its zero points: the tensor named the
    weight's name + `suffix`, made per-output-channel or grouped by `read`) as a TensorSource by the weights' names,
    so they load one layer at a time, as the weights do; the last one read is kept for the shape and shard reads
    that follow it."""

    def __init__(self, folder: TensorSource, spec: ModelSpec, read: Callable, suffix: str):
        self.folder, self.spec, self.read, self.suffix = folder, spec, read, suffix
        self._last: tuple[str, np.ndarray] | None = None

    def _read(self, name: str) -> np.ndarray:
        if self._last is None or self._last[0] != name:
            num_out, stored_in = self.folder.shape(name)  # a Linear weight (out, in), int4's two inputs to a byte
            num_in = stored_in * (INT4_PER_BYTE if self.spec.checkpoint_quantization == "int4" else 1)
            values = self.read(self.folder, (name, num_out, num_in), name + self.suffix,
                               self.spec.checkpoint_weight_block)
            self._last = name, values
        return self._last[1]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of what a weight has."""
        return self._read(name).shape

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """What a weight has, or only its `index` part."""
        values = self._read(name)
        return values if index is None else values[index]


def _channel_scale(folder: TensorSource, weight: tuple[str, int, int], scale_name: str, _) -> np.ndarray:
    """(out,) float32: a weight's `weight_scale`, one per output channel or one for the tensor (`weight`: its name
    and (out, in) size)."""
    _, num_out, _ = weight
    stored = folder.get(scale_name).astype(np.float32).reshape(-1)  # (out,) or (1,)
    if stored.size not in (1, num_out):
        raise ValueError(f"{scale_name} has {stored.size} values for {num_out} output channels")
    return np.array(np.broadcast_to(stored, (num_out,)))


def _block_scale(folder: TensorSource, weight: tuple[str, int, int], scale_name: str,
                 block: tuple[int, int]) -> np.ndarray:
    """(in // block columns, out) float32: a weight's (out, in) block scales, (ceil(out / rows), ceil(in / columns)),
    as grouped scales (model/quantize.py): each block's scale repeated over its output channels (an int4 group is a
    block of one row; `weight`: its name and (out, in) size)."""
    name, num_out, num_in = weight
    rows, columns = block
    if num_in % columns:
        raise ValueError(f"{name} has {num_in} input columns, not a multiple of the checkpoint's block of {columns} "
                         "(weight_block_size, group_size): jaxserve needs whole blocks along the input dimension")
    stored = folder.get(scale_name).astype(np.float32)
    if stored.shape != (-(-num_out // rows), num_in // columns):
        raise ValueError(f"{scale_name} has shape {stored.shape}; blocks of {block} over {name}'s "
                         f"{(num_out, num_in)} need {(-(-num_out // rows), num_in // columns)}")
    return np.repeat(stored, rows, axis=0)[:num_out].T  # (groups, out)


def _group_zero_points(folder: TensorSource, weight: tuple[str, int, int], zero_name: str,
                       block: tuple[int, int], stored_less: int = 0) -> np.ndarray:
    """(in // group size, out) int8 in [-8, 7] (to 8 when `stored_less`): an asymmetric int4 weight's zero points,
    stored int32 (out / 8, groups), eight output channels' values to a word from the lowest bits up, each plus 8
    (compressed-tensors packs them along the outputs), less `stored_less` (GPTQ's)."""
    name, num_out, num_in = weight
    if zero_name not in folder:
        raise ValueError(f"{name} is asymmetric int4 but the checkpoint has no {zero_name}")
    groups = num_in // block[1]
    words = np.ascontiguousarray(folder.get(zero_name), dtype="<i4")  # (ceil(out / 8), groups)
    if words.shape != (-(-num_out // 8), groups):
        raise ValueError(f"{zero_name} has shape {words.shape}; {name}'s {num_out} output channels in {groups} "
                         f"groups need {(-(-num_out // 8), groups)}")
    return (unpack_int4_rows(words.T)[:, :num_out] + stored_less - 8).astype(np.int8)  # (groups, out)


def _row_groups(folder: TensorSource, weight: tuple[str, int, int], groups_name: str,
                block: tuple[int, int]) -> np.ndarray:
    """(in,) int32: each input row's group (GPTQ's act-order `g_idx`), checked to name one of the weight's groups."""
    name, _, num_in = weight
    stored = np.asarray(folder.get(groups_name)).astype(np.int64)  # (in,)
    groups = num_in // block[1]
    if stored.shape != (num_in,) or stored.min() < 0 or stored.max() >= groups:
        raise ValueError(f"{groups_name} must give each of {name}'s {num_in} input rows one of its {groups} groups, "
                         f"got shape {stored.shape} and values {stored.min()}..{stored.max()}")
    return stored.astype(np.int32)


def _check_groups_split_evenly(name: str, groups: int, block: tuple[int, int], mesh: Mesh, axes) -> None:
    """ValueError unless the devices that split a weight's input rows each get whole blocks of them."""
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    ways = int(np.prod([mesh.shape[axis] for axis in axes]))
    if groups % ways:
        raise ValueError(f"{name}'s {groups} blocks of {block[1]} input rows do not split over {ways} devices: "
                         f"choose a tensor_parallel_size that divides {groups}")


def _read_slice(folder: TensorSource, name: str | list, layout: _Layout, dtype, shape: tuple[int, ...],
                index: tuple[slice, ...]) -> np.ndarray:
    """The tensor of `shape` at `index` (a slice per axis), in `dtype`: a checkpoint tensor's slice, or for a list
    (a stacked leaf's layers, a layer's experts) the slices of the items `index[0]` covers, each read the same way,
    stacked along the first axis."""
    if isinstance(name, list):
        return np.stack([_read_slice(folder, name[i], layout, dtype, shape[1:], index[1:])
                         for i in range(*index[0].indices(shape[0]))])
    return layout.read(folder, name, index, shape).astype(dtype, copy=False)


def _load_stacked(folder: TensorSource, names: list, layout: _Layout, sharding, dtype,
                  into: jax.Array | None = None) -> jax.Array:
    """A stacked (num_layers, ...) leaf, from one tensor per layer or one list of expert tensors per layer: allocated
    on the devices (or `into`, when given and of this shape, dtype and sharding), then filled one layer at a time (the
    update donates the stack, so the devices hold it once plus one layer). A new leaf whose device shard is at most
    HOST_STACKED_BYTES is built on the host in one piece instead, compiling no program."""
    def layer_shape_of(name) -> tuple[int, ...]:
        return (len(name), *layout.shape(folder.shape(name[0]))) if isinstance(name, list) else \
            layout.shape(folder.shape(name))

    layer_shape = layer_shape_of(names[0])
    for name in names:
        if layer_shape_of(name) != layer_shape:
            raise ValueError(f"weight {name!r} has shape {layer_shape_of(name)}, unlike layer 0's {layer_shape}")
    shape = (len(names), *layer_shape)
    reusable = into is not None and not into.is_deleted() and (into.shape, into.dtype, into.sharding) == (
        shape, jnp.dtype(dtype), sharding)
    if not reusable and math.prod(sharding.shard_shape(shape)) * jnp.dtype(dtype).itemsize <= HOST_STACKED_BYTES:
        return _load_one(folder, names, layout, sharding, dtype, shape)
    layer_sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    stacked = into if reusable else jnp.zeros(shape, dtype, device=sharding)
    put = _layer_update(sharding)
    for i, name in enumerate(names):
        stacked = put(stacked, _load_one(folder, name, layout, layer_sharding, dtype, layer_shape), i)
    return stacked


def dummy_params(spec: ModelSpec, mesh: Mesh, dtype: jnp.dtype, num_cache_kv_heads: int, seed: int,
                 declared: dict | None = None) -> dict:
    """Random weights of the declared shapes (`declared`: when not the registered architecture's), made on the
    device in their final sharding (load_format "dummy", for benchmarks of shapes whose real weights are not at
    hand): N(0, 0.02^2), norms 1."""
    declared = declared or model_for(spec.architecture).weights(spec, num_cache_kv_heads, mesh.devices.size)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree_util.tree_leaves(
        declared, is_leaf=lambda node: isinstance(node, Weight)))))

    def make(name: str, weight: Weight) -> jax.Array:
        maker = _random_weight_maker(tuple(weight.shape), jnp.dtype(dtype), NamedSharding(mesh, weight.spec),
                                     weight.ones)
        return maker(None if weight.ones else next(keys))  # (a norm's ones take no key)

    return map_weights(make, declared)


@functools.lru_cache(maxsize=None)
def _random_weight_maker(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding, ones: bool):
    """The jitted maker of one dummy weight (a key, None for ones -> the array of `shape`): one per (shape, dtype,
    sharding), so weights alike (gate and up, a model built twice) trace and compile once."""
    if ones:
        return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=sharding)
    return jax.jit(lambda key: 0.02 * jax.random.normal(key, shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _layer_update(sharding: NamedSharding):
    """The jitted `stack[i] = layer` (stack donated) of stacks in `sharding`: one function per sharding, so each
    (shape, dtype) compiles once however many leaves and loads share it."""
    return jax.jit(lambda stack, layer, i: jax.lax.dynamic_update_index_in_dim(stack, layer, i, 0),
                   donate_argnums=0, out_shardings=sharding)
