"""Compiled step executables on disk, keyed by what they were traced from, so that a restart skips tracing and
lowering as well as XLA's compile.

JAX's persistent compilation cache is keyed by the lowered program: a warm start still traces and lowers every
bucket (0.15-0.2 s each for the bundled model on a CPU core, more for a large model) to find its entry. This store
is keyed by the runner's shared key instead (`Runner.trace_key`, the step function's name, the arguments' tree,
shapes, dtypes and shardings; executables.py), made stable across processes with the jaxserve source, the jax and
XLA versions and flags, and the devices, so a hit is one file read and a deserialization.

Entries are zlib-compressed pickles (`jax.experimental.serialize_executable`), and unpickling runs code: the store
is used only in a folder this user owns that no one else can write to (created 0700), and only files this user owns
are read. Multi-process (multi-host) engines do not use it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import logging
import os
import pickle
import tempfile
import zlib

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

logger = logging.getLogger(__name__)

FOLDER_NAME = "jaxserve-executables"  # inside the compilation cache folder
MAX_ENTRIES = 4096  # past this, opening the store removes the least recently written entries
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the jaxserve package


def stable_description(value) -> object:
    """`value` as nested tuples of plain values that print the same in every process (a mesh and a sharding by
    their device ids, which their reprs leave out; a function or class by its module and name). Raises ValueError
    for a value with no such description (a closure, lambda or local class, whose captured values could differ; an
    address)."""
    if isinstance(value, Mesh):
        return ("Mesh", value.axis_names, value.devices.shape, tuple(int(d.id) for d in value.devices.flat))
    if isinstance(value, NamedSharding):
        return ("NamedSharding", stable_description(value.mesh), str(value.spec), value.memory_kind)
    if isinstance(value, SingleDeviceSharding):
        return ("SingleDeviceSharding", int(next(iter(value.device_set)).id), value.memory_kind)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(stable_description(item) for item in value))
    if isinstance(value, np.ndarray):  # (its repr elides the middle of a large array)
        digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        return ("ndarray", str(value.dtype), value.shape, digest)
    if isinstance(value, dict):
        return ("dict", *((repr(key), stable_description(item)) for key, item in sorted(value.items(), key=repr)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, *((field.name, stable_description(getattr(value, field.name)))
                                            for field in dataclasses.fields(value)))
    if callable(value) and hasattr(value, "__qualname__"):  # a function or a class
        if "<" in value.__qualname__:  # <locals>, <lambda>: what it captured could differ
            raise ValueError(f"no stable description of {value!r}")
        return ("function" if not isinstance(value, type) else "class", value.__module__, value.__qualname__)
    text = repr(value)
    if " at 0x" in text:
        raise ValueError(f"no stable description of {text}")
    return text


@functools.cache
def _environment() -> tuple:
    """What besides the key decides a program: jaxserve's source, jax, jaxlib and XLA settings, the devices."""
    source = hashlib.sha256()
    for folder, _, files in sorted(os.walk(SOURCE_ROOT)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    source.update(name.encode() + f.read())
    devices = jax.devices()
    return (source.hexdigest(), jax.__version__, jaxlib.__version__, devices[0].client.platform_version,
            os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
            jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision),
            tuple((d.id, d.platform, d.device_kind) for d in devices))


def _private_folder(path: str) -> bool:
    """Whether `path` is a folder of this user's that no one else can write to."""
    info = os.stat(path)
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


class ExecutableStore:
    """Compiled executables in a private folder, by shared key (executables.shared_executable's)."""

    def __init__(self, folder: str):
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if not _private_folder(folder):
            raise PermissionError(f"{folder} is not this user's alone (owner or group/other write bits)")
        self.folder = folder
        self.num_loaded = 0
        self.num_saved = 0
        self._warned = False  # a failed save was logged
        self._prune()

    def _prune(self) -> None:
        """Keep the MAX_ENTRIES most recently written entries."""
        entries = [entry for entry in os.scandir(self.folder) if entry.name.endswith(".executable")]
        if len(entries) > MAX_ENTRIES:
            entries.sort(key=lambda entry: entry.stat().st_mtime)
            for entry in entries[: len(entries) - MAX_ENTRIES]:
                os.remove(entry.path)

    def _path(self, key: tuple) -> str | None:
        """The entry's file for `key`, or None when the key has no stable description."""
        try:
            description = repr((_environment(), stable_description(key)))
        except ValueError as error:
            logger.debug("executable store: %s", error)
            return None
        return os.path.join(self.folder, hashlib.sha256(description.encode()).hexdigest() + ".executable")

    def load(self, key: tuple) -> jax.stages.Compiled | None:
        """The stored executable of `key`, loaded onto its devices, or None."""
        path = self._path(key)
        if path is None or not os.path.exists(path):
            return None
        try:
            if os.stat(path).st_uid != os.getuid():
                return None
            with open(path, "rb") as f:
                blob, in_tree, out_tree, device_ids = pickle.loads(zlib.decompress(f.read()))
            devices = {d.id: d for d in jax.devices()}
            executable = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, backend=devices[device_ids[0]].client,
                execution_devices=[devices[i] for i in device_ids])
        except Exception as error:  # a torn or stale entry: compile instead
            logger.warning("executable store: could not load %s (%s); compiling instead", path, error)
            return None
        self.num_loaded += 1
        return executable

    def save(self, key: tuple, executable: jax.stages.Compiled, cached: bytes | None = None) -> None:
        """Write `executable` under `key` (nothing when the key or the executable cannot be stored); `cached`: its
        XLA executable as JAX's persistent cache held it, for one loaded from there."""
        path = self._path(key)
        if path is None:
            return
        try:
            blob, in_tree, out_tree = _serialize(executable, cached)
            device_ids = [d.id for d in executable.runtime_executable().local_devices()]  # in execution order
            record = zlib.compress(pickle.dumps((blob, in_tree, out_tree, device_ids)), 1)  # 4x smaller, ~4 ms
        except (ValueError, NotImplementedError) as error:  # what serialize refuses (constants, mutable refs)
            logger.debug("executable store: not storing %s: %s", key[1:2], error)
            return
        except Exception as error:  # anything else (another jax, another backend): go on without storing
            self._warn_once(f"executable store: not storing executables ({type(error).__name__}: {error})")
            return
        try:
            handle, scratch = tempfile.mkstemp(dir=self.folder, suffix=".partial")
            with os.fdopen(handle, "wb") as f:
                f.write(record)
            os.replace(scratch, path)  # whole or not at all, for a reader in another process
        except OSError as error:  # a full disk, a folder removed meanwhile
            self._warn_once(f"executable store: could not write {path} ({error})")
            return
        self.num_saved += 1

    def _warn_once(self, message: str) -> None:
        """Log `message` as a warning, the first such message of this store only."""
        if not self._warned:
            logger.warning(message)
            self._warned = True


def _serialize(executable: jax.stages.Compiled, cached: bytes | None) -> tuple[bytes, object, object]:
    """(blob, in_tree, out_tree) of `executable` as `serialize_executable.serialize` makes them, with its XLA
    executable as the bytes `cached` where given (one loaded from JAX's persistent cache, which XLA's CPU backend
    would serialize again without its machine code)."""
    if cached is None:
        return serialize_executable.serialize(executable)

    pickler = serialize_executable._JaxPjrtPickler  # (jax internals: the pickler `serialize` uses)
    executable_types = (serialize_executable.xc.LoadedExecutable, serialize_executable._jax.Executable)

    class CachedBytesPickler(pickler):
        def persistent_id(self, obj):
            return ("exec", cached) if isinstance(obj, executable_types) else super().persistent_id(obj)

    serialize_executable.serialize(executable)  # jax's own checks: what it cannot serialize raises here
    args_info, in_tree = jax.tree_util.tree_flatten(executable.args_info)
    with io.BytesIO() as file:
        CachedBytesPickler(file).dump((executable._executable._unloaded_executable, args_info, executable._no_kwargs))
        return file.getvalue(), in_tree, executable.out_tree


def open_store(cache_dir: str | None) -> ExecutableStore | None:
    """The store inside the compilation cache folder `cache_dir`, or None (no folder, several processes, or a
    folder others can write to)."""
    if not cache_dir or jax.process_count() > 1:
        return None
    try:
        return ExecutableStore(os.path.join(cache_dir, FOLDER_NAME))
    except OSError as error:  # (PermissionError among them: a folder others can write to)
        logger.warning("executable store off: %s", error)
        return None
