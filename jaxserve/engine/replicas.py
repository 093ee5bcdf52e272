"""Data-parallel replicas (`data_parallel_size`): several engines of one model in one server, each over its own
devices, behind one front end that sends each request to one of them.

`ReplicaRouter` picks the replica: the one with the fewest outstanding tokens (the prompt and output budget of
every request it holds that has not finished), less the prompt tokens it probably holds in its prefix cache
already (the longest run of whole prompt pages whose hash chain it saw lately), so requests sharing a prefix go
where that prefix is, unless that replica is busier by more than the prefix saves. `DataParallelEngine` is an
`AsyncLLMEngine` to the server (the same methods), made of one AsyncLLMEngine per replica.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from jaxserve.engine.async_engine import (
    AsyncEngineBase,
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineSleepingError,
    RequestStream,
)
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.kv.cache_manager import page_hash, root_hash
from jaxserve.request import Request

# Prompt pages whose hashes the router follows per request, and hashes it remembers per replica (least recently
# seen forgotten first): a bounded guess at each replica's prefix cache.
ROUTED_PREFIX_PAGES = 64
REMEMBERED_PAGES = 65536


class ReplicaRouter:
    """Least outstanding tokens, prefix-cache aware. Not thread-safe: call it from one thread (the event loop)."""

    def __init__(self, num_replicas: int, page_size: int):
        self.page_size = page_size
        self.outstanding = [0] * num_replicas  # tokens each replica has still to compute for its requests
        self.routed_tokens = [0] * num_replicas  # tokens ever routed to each replica (its share of the load)
        self._seen: list[collections.OrderedDict[bytes, None]] = [
            collections.OrderedDict() for _ in range(num_replicas)]

    def page_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
        """The hash chain of the prompt's first whole pages (ROUTED_PREFIX_PAGES at most), as the prefix cache
        chains them (kv/cache_manager.py: a salt starts its own chain)."""
        hashes, parent = [], root_hash(cache_salt)
        for start in range(0, min(len(token_ids) // self.page_size, ROUTED_PREFIX_PAGES) * self.page_size,
                           self.page_size):
            parent = page_hash(parent, tuple(token_ids[start:start + self.page_size]))
            hashes.append(parent)
        return hashes

    def cached_tokens(self, replica: int, hashes: list[bytes]) -> int:
        """Prompt tokens of the longest run of `hashes` replica saw lately."""
        seen = self._seen[replica]
        count = 0
        while count < len(hashes) and hashes[count] in seen:
            count += 1
        return count * self.page_size

    def route(self, token_ids: list[int], cost: int, cache_salt: str | None = None) -> int:
        """The replica for a request of `token_ids` (and `cache_salt`) that will cost `cost` tokens; counts it as
        outstanding there."""
        hashes = self.page_hashes(token_ids, cache_salt)
        replica = min(range(len(self.outstanding)),
                      key=lambda r: (self.outstanding[r] - self.cached_tokens(r, hashes), self.outstanding[r],
                                     self.routed_tokens[r]))
        self.outstanding[replica] += cost
        self.routed_tokens[replica] += cost
        seen = self._seen[replica]
        for digest in hashes:
            seen[digest] = None
            seen.move_to_end(digest)
        while len(seen) > REMEMBERED_PAGES:
            seen.popitem(last=False)
        return replica

    def finished(self, replica: int, cost: int) -> None:
        """A request routed to `replica` has finished (or was aborted)."""
        self.outstanding[replica] -= cost

    def forget_prefixes(self) -> None:
        """The replicas' prefix caches were reset."""
        for seen in self._seen:
            seen.clear()


def request_cost(requests: list[Request]) -> int:
    """Tokens a request's samples will make a replica compute: each one's prompt and output budget."""
    return sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens for r in requests)


class DataParallelEngine:
    """One front end over several async engines (replicas of one model over disjoint devices: AsyncLLMEngines in
    this process, or engine-core processes' clients); the server uses it as it uses one async engine."""

    def __init__(self, replicas: list[AsyncEngineBase]):
        self.replicas = replicas
        self.model = replicas[0].model  # the model, validation and the grammar compiler (all alike)
        self.tokenizer = replicas[0].tokenizer
        self.max_waiting_requests = replicas[0].max_waiting_requests  # requests accepted, not started, in all
        self.router = ReplicaRouter(len(replicas), self.model.kv_cache.page_size)

    def set_hooks(self, on_outputs, on_step, on_moves=None) -> None:
        """Set every replica's metrics hooks (AsyncEngineBase.set_hooks)."""
        for replica in self.replicas:
            replica.set_hooks(on_outputs, on_step, on_moves)

    @property
    def error(self) -> BaseException | None:
        """The first replica's failure, if any has failed."""
        return next((replica.error for replica in self.replicas if replica.error is not None), None)

    def start(self) -> None:
        """Start every replica's engine thread (from the event loop)."""
        for replica in self.replicas:
            replica.start()

    async def stop(self) -> None:
        """Stop every replica."""
        for replica in self.replicas:
            await replica.stop()

    @property
    def is_running(self) -> bool:
        """True while every replica runs (one failed replica makes the server unhealthy, to be restarted)."""
        return all(replica.is_running for replica in self.replicas)

    def replica_stats(self) -> list[dict]:
        """Each replica's counters (EngineCore.stats), in replica order: the metrics' `replica` label."""
        return [replica.stats() for replica in self.replicas]

    def _num_unstarted(self) -> int:
        return sum(replica.stats()["num_requests_unstarted"] for replica in self.replicas)

    def make_requests(self, request_id: str, prompt, params, priority: int = 0, cache_salt: str | None = None,
                      lora_name: str | None = None):
        """Validate one request (ValueError when invalid) without queueing it (any replica validates alike: each
        loaded the same LoRA adapters into the same slots)."""
        return self.replicas[0].make_requests(request_id, prompt, params, priority, cache_salt, lora_name)

    def make_pooling_requests(self, request_id: str, prompt, params, priority: int = 0, cache_salt: str | None = None,
                              lora_name: str | None = None, task: str = "embed"):
        """Validate one pooling request of `task` (ValueError when invalid) without queueing it."""
        return self.replicas[0].make_pooling_requests(request_id, prompt, params, priority, cache_salt, lora_name,
                                                      task)

    def check_capacity(self, num_requests: int = 1) -> None:
        """EngineDeadError when a replica is down, EngineOverloadedError past the replicas' waiting requests."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.error!r}" if self.error
                                  else "the engine is not running")
        if self.is_sleeping():
            raise EngineSleepingError("the engine is asleep (sleep mode): wake it up first (POST /wake_up)")
        if self._num_unstarted() + num_requests > self.max_waiting_requests:
            raise EngineOverloadedError(f"{self._num_unstarted()} requests are already waiting to start "
                                        f"(max_waiting_requests={self.max_waiting_requests}); retry later")

    def submit(self, request_id: str, made: tuple, whole: bool = False) -> RequestStream:
        """Queue a validated request on the replica the router picks (`whole`: see AsyncEngineBase.submit); its
        outstanding tokens count there until its stream closes."""
        requests = made[1]
        cost = request_cost(requests)
        replica = self.router.route(requests[0].prompt_token_ids, cost, requests[0].cache_salt)
        return self.replicas[replica].submit(request_id, made,
                                             on_close=lambda: self.router.finished(replica, cost), whole=whole)

    async def compile_grammar(self, constraint) -> None:
        """Compile an output constraint (the replicas share one grammar compiler: same tokenizer)."""
        await self.replicas[0].compile_grammar(constraint)

    async def add_lora(self, lora_request) -> str:
        """Load a LoRA adapter on every replica, one after the other: each takes it into the same slot (the lowest
        free one), since every replica loaded the same adapters in the same order."""
        for replica in self.replicas:
            await replica.add_lora(lora_request)
        return lora_request.lora_name

    async def remove_lora(self, name: str) -> None:
        """Free an adapter's slot on every replica."""
        for replica in self.replicas:
            await replica.remove_lora(name)

    async def update_weights(self, source) -> int:
        """Serve new weights on every replica (each reads its own copy onto its devices); the weights version."""
        versions = await asyncio.gather(*(replica.update_weights(source) for replica in self.replicas))
        self.router.forget_prefixes()  # the replicas' caches were forgotten, and new requests' salts changed
        return versions[0]

    async def sleep(self, level: int = 1) -> None:
        """Put every replica to sleep (each frees its own devices)."""
        await asyncio.gather(*(replica.sleep(level) for replica in self.replicas))
        self.router.forget_prefixes()  # the replicas' caches were forgotten

    async def wake_up(self) -> None:
        """Wake every replica."""
        await asyncio.gather(*(replica.wake_up() for replica in self.replicas))

    def is_sleeping(self) -> bool:
        """True while a replica sleeps."""
        return any(replica.is_sleeping() for replica in self.replicas)

    async def kv_page_states(self) -> list[list[int]]:
        """The first replica's KV pool map, run-length encoded (EngineCore.kv_page_states): a monitor's sample of
        the replicas, which share one configuration."""
        return await self.replicas[0].kv_page_states()

    async def reset_prefix_cache(self) -> int:
        """Forget every replica's cached pages; returns how many were forgotten in all."""
        forgotten = await asyncio.gather(*(replica.reset_prefix_cache() for replica in self.replicas))
        self.router.forget_prefixes()
        return sum(forgotten)


def build_replicas(engine: LLMEngine, make_async: Callable[[LLMEngine], AsyncLLMEngine]) -> list[AsyncLLMEngine]:
    """`engine` (replica 0) and data_parallel_size - 1 more engines of its config, replica i over the devices
    [i * tp, (i + 1) * tp), each made an AsyncLLMEngine by `make_async`. Requests are made
    (validated, seeded, their constraints compiled) by replica 0 whichever replica runs them."""
    config = engine.config
    engines = [engine]
    for replica in range(1, config.parallel_config.data_parallel_size):
        first_device = replica * config.parallel_config.tensor_parallel_size
        engines.append(LLMEngine(config, show_progress=False, first_device=first_device))
    return [make_async(each) for each in engines]
