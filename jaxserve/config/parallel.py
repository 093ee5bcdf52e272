"""The parallel part of the engine's config: devices per engine, replicas, and the processes of a multi-host
engine."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import SERVE_ONLY, check_bools, check_positive_ints, option


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Tensor, expert and data parallelism, and multi-host launch (vLLM's ParallelConfig)."""

    tensor_parallel_size: int = option(1, "devices on the model mesh axis")
    enable_expert_parallel: bool = option(
        False, "a mixture of experts: split the experts whole over the tensor-parallel devices instead of each "
        "expert")
    data_parallel_size: int = option(
        1, "engine replicas over disjoint sets of --tensor-parallel-size devices behind one server",
        commands=SERVE_ONLY)
    distributed_coordinator: str | None = option(
        None, "multi-host: process 0's address, the same on every process (auto: from the cluster launcher's "
        "environment); process 0 leads, the others follow its steps", default_text="one process",
        commands=SERVE_ONLY, metavar="HOST:PORT")
    num_processes: int = option(1, "multi-host: how many processes (one per host)", commands=SERVE_ONLY)
    process_id: int = option(0, "multi-host: this process's rank, 0 (the leader) to N - 1", commands=SERVE_ONLY)
    distributed_timeout_s: float = option(
        60.0, "multi-host: seconds to wait for the coordinator and the other processes at start-up",
        commands=SERVE_ONLY)

    def __post_init__(self):
        check_bools(self, "enable_expert_parallel")
        check_positive_ints(self, "tensor_parallel_size", "num_processes", "data_parallel_size")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes) = [0, {self.num_processes}), "
                             f"got {self.process_id!r}")
        if not 0 < self.distributed_timeout_s < float("inf"):
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, "
                             f"got {self.distributed_timeout_s!r}")
        self._check_coordinator()

    def _check_coordinator(self) -> None:
        """ValueError for launch arguments that do not fit together (multi-host, data parallel)."""
        coordinator = self.distributed_coordinator
        if coordinator is None:
            if self.num_processes > 1:
                raise ValueError(f"num_processes {self.num_processes} needs distributed_coordinator: process 0's "
                                 f"HOST:PORT (or auto, from the cluster launcher's environment)")
            return
        if coordinator != "auto":
            host, _, port = coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"distributed_coordinator must be HOST:PORT (process 0's address) or auto, "
                                 f"got {coordinator!r}")
            if self.num_processes == 1:
                raise ValueError("distributed_coordinator is set but num_processes is 1: give every process "
                                 "--num-processes N and its own --process-id")
        if self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs replicas in one process: for replicas of a multi-host "
                             "engine, launch one multi-host engine per replica behind a router (docs/deployment.md)")

    def check_one_replica(self, where: str) -> None:
        """ValueError when `data_parallel_size` asks for replicas where only one engine runs (`where`)."""
        if self.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size > 1 is for `jaxserve serve` (replicas behind one front end); "
                             f"{where} runs one engine: run one per set of devices")
