"""Which weights an engine serves and whether it sleeps: the checks of `update_weights` (model/weight_update.py),
the weights version every request's prefix salt carries, and sleep mode's state (what a wake-up reads)."""

from __future__ import annotations

from collections.abc import Mapping

from jaxserve.model.checkpoint import is_checkpoint
from jaxserve.model.loader import SafetensorsFolder, TensorMapping, check_source
from jaxserve.model_spec import ModelSpec


class WeightControl:
    """The served weights' version and source, and the sleep level (0 awake)."""

    def __init__(self, spec: ModelSpec, num_cache_kv_heads: int, num_devices: int, multi_host: bool,
                 weights_folder: str | None):
        self.spec = spec
        self.num_cache_kv_heads = num_cache_kv_heads
        self.num_devices = num_devices
        self.multi_host = multi_host
        self.version = 0  # weight updates so far; part of every request's prefix salt
        self.sleep_level = 0  # 0 awake, else the level slept at
        self.pending: str | TensorMapping | None = None  # what update_weights gave while asleep: read at wake-up
        self.folder = weights_folder  # the Hugging Face folder the served weights came from, when they did

    def check_awake(self, to: str) -> None:
        """ValueError while the engine sleeps, saying what it cannot do (`to`) and how to wake it."""
        if self.sleep_level:
            raise ValueError(f"the engine is asleep (sleep level {self.sleep_level}) and cannot {to}: call wake_up() "
                             "first")

    def checked_source(self, source: str | Mapping[str, object]) -> str | TensorMapping:
        """`source` (a Hugging Face folder, or arrays by their Hugging Face names) checked against the served
        model before anything is written: a ValueError saying what does not fit."""
        if isinstance(source, str):
            if is_checkpoint(source):
                raise ValueError(f"update_weights: {source!r} is a converted (orbax) folder; give the Hugging Face "
                                 "folder (safetensors) it was converted from")
            folder = SafetensorsFolder(source)
        elif not isinstance(source, Mapping):
            raise ValueError(f"update_weights takes a folder path or a mapping of Hugging Face tensor names to "
                             f"arrays, got {type(source).__name__}")
        elif self.multi_host:
            raise ValueError("a multi-host engine takes new weights from a folder every host can read, not from "
                             "arrays in this process's memory")
        else:
            folder = source = TensorMapping(source)
        try:
            check_source(folder, self.spec, self.num_cache_kv_heads, self.num_devices)
        except ValueError as error:
            raise ValueError(f"update_weights: these weights do not fit the served model: {error}") from error
        return source

    def updated(self, source: str | TensorMapping) -> int:
        """Count an update from `source` (kept to be read at wake-up while asleep); returns the new version."""
        if self.sleep_level:
            self.pending = source
        self.folder = source if isinstance(source, str) else None
        self.version += 1
        return self.version

    def check_can_sleep(self, enabled: bool, level: int, unfinished: int) -> None:
        """ValueError when the engine cannot sleep at `level`: sleep mode off, a bad level, asleep already, a
        multi-host engine, or `unfinished` requests."""
        if not enabled:
            raise ValueError("sleep needs an engine started with enable_sleep_mode (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (weights discarded), got "
                             f"{level!r}")
        if self.sleep_level:
            raise ValueError(f"the engine is already asleep (sleep level {self.sleep_level})")
        if self.multi_host:
            raise ValueError("a multi-host engine cannot sleep: its weights are spread over the hosts' memories")
        if unfinished:
            raise ValueError(f"{unfinished} request(s) are unfinished: let them finish or abort them before sleep")

    def fell_asleep(self, level: int) -> None:
        """Record that the engine sleeps at `level` (its device memory freed)."""
        self.sleep_level = level

    def woke_up(self) -> None:
        """Record that the engine is awake again, the weights asleep updates gave now served."""
        self.sleep_level, self.pending = 0, None

    def wake_source(self) -> str | TensorMapping | None:
        """What a wake-up reads the weights from: what update_weights gave while asleep, or after level 2 the
        folder they came from (None: from host memory). ValueError after level 2 with nothing to read."""
        if self.pending is None and self.sleep_level == 2:
            if self.folder is None:
                raise ValueError("wake_up: the weights were discarded (sleep level 2) and came from no Hugging Face "
                                 "folder the engine can read again: give them with update_weights(...) first")
            return self.folder
        return self.pending
