"""The LoRA adapters an engine serves: which adapter sits in which of the params' `max_loras` slots (model/lora.py),
loaded and freed by name between steps."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable

from jaxserve.lora_request import LoRARequest
from jaxserve.model.lora import read_adapter
from jaxserve.model.registry import model_for
from jaxserve.model_spec import ModelSpec
from jaxserve.request import Request
from jaxserve.runner.runner import Runner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedLora:
    """A LoRA adapter in a slot of the params (model/lora.py)."""

    slot: int
    request: LoRARequest  # how it was asked for (its name and folder)
    key: str  # unique to this load: what the prefix cache keys the adapter's pages by


class LoraSlots:
    """The adapters in the slots, by name. The runner is passed to each call that writes a slot: a multi-host
    leader's runner mirrors the write to every process."""

    def __init__(self, spec: ModelSpec, max_loras: int, max_lora_rank: int, num_cache_kv_heads: int):
        self.spec = spec
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.num_cache_kv_heads = num_cache_kv_heads
        self.loaded: dict[str, LoadedLora] = {}
        self._loads = itertools.count()

    def add(self, request: LoRARequest, runner: Runner) -> int:
        """Load an adapter into a free slot (one loaded before under the same name and folder keeps its slot);
        returns the slot. ValueError when the name is taken by another folder, every slot holds one, or the
        adapter cannot be served."""
        loaded = self.loaded.get(request.lora_name)
        if loaded is not None:
            if loaded.request.lora_path != request.lora_path:
                raise ValueError(f"LoRA adapter name {request.lora_name!r} is taken by {loaded.request.lora_path}")
            return loaded.slot
        taken = {loaded.slot for loaded in self.loaded.values()}
        free = [slot for slot in range(self.max_loras) if slot not in taken]
        if not free:
            raise ValueError(f"every one of the max_loras={self.max_loras} adapter slots holds an adapter "
                             f"({', '.join(self.loaded)}): raise max_loras, or remove one")
        adapter = read_adapter(request.lora_path, self.spec, self.max_lora_rank, self.num_cache_kv_heads,
                               set(runner.params["layers"]["lora"]),
                               model_for(self.spec.architecture).fused_parts(self.spec))
        runner.set_lora(free[0], adapter)
        self.loaded[request.lora_name] = LoadedLora(free[0], request, f"{request.lora_name}#{next(self._loads)}")
        logger.info("LoRA adapter %r from %s in slot %d", request.lora_name, request.lora_path, free[0])
        return free[0]

    def remove(self, name: str, unfinished: Iterable[Request], runner: Runner) -> None:
        """Free the slot of the adapter loaded as `name`; ValueError while one of the `unfinished` requests runs
        with it. (Its cached prefix pages can never be taken again: a later load is keyed anew.)"""
        loaded = self.get(name)
        users = [r.request_id for r in unfinished if r.lora_slot == loaded.slot]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished request(s)")
        runner.set_lora(loaded.slot, {})
        del self.loaded[name]

    def get(self, name: str) -> LoadedLora:
        """The adapter loaded as `name`; ValueError naming the loaded ones otherwise."""
        if name not in self.loaded:
            loaded = ", ".join(self.loaded) or "none"
            raise ValueError(f"no LoRA adapter {name!r} is loaded (loaded: {loaded})")
        return self.loaded[name]

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict:
        """The adapters running and waiting requests use, by name, and max_loras."""
        names = {loaded.slot: name for name, loaded in self.loaded.items()}

        def used(requests: Iterable[Request]) -> list[str]:
            return sorted({names[r.lora_slot] for r in requests if r.lora_slot in names})

        return {"max_loras": self.max_loras, "running": used(running), "waiting": used(waiting)}
