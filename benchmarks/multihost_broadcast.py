"""What the multi-host step channel costs per step, against the step itself and against JAX's own ways to send
the same bytes, side by side in one two-process launch on this machine.

    python benchmarks/multihost_broadcast.py
    python benchmarks/multihost_broadcast.py --num-requests 32 --output-len 64 --repeats 5

Two processes of two simulated CPU devices each (gloo collectives) run the bundled model at tensor parallel 4
(jaxserve/distributed/). The leader generates --num-requests random-token prompts (16-64 tokens, --output-len
greedy tokens each) --repeats times after one warm-up run (which measures the messages' sizes), timing every
`LeaderChannel.send` (pickling the call and writing it to the follower) and counting the engine's steps: per
step, the channel's time against the step's wall time. Then both processes send a message of the typical size through
`multihost_utils.broadcast_one_to_all` (a collective) and through JAX's distributed key-value store (set, then the
follower's blocking get), --calls times each, the other ways the leader could have handed the followers a step. Mean and
best over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import time

import numpy as np


def worker(coordinator: str, process_id: int, args: argparse.Namespace) -> None:
    """One process of the launch; the leader prints the result as one JSON line."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    from jax._src import distributed as jax_distributed
    from jax.experimental import multihost_utils

    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.effects import timed_methods
    from jaxserve.bench.workloads import random_workload, vocab_ids
    from jaxserve.distributed.channel import LeaderChannel

    engine_options = dict(tensor_parallel_size=4, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=32,
                          num_pages=128, enable_structured_outputs=False, show_progress=False,
                          distributed_coordinator=coordinator, num_processes=2, process_id=process_id)
    try:
        llm = LLM(**engine_options)
    except SystemExit:  # a follower: the leader's run is over; on to the side-by-side sends
        llm = None
    result = {}
    if llm is not None:
        workload = random_workload(args.num_requests, vocab_ids(llm.get_tokenizer()), "uniform", 40, 16, 64, "fixed",
                                   args.output_len, args.output_len, args.output_len, seed=0)
        prompts = [request.prompt_token_ids for request in workload.requests]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        sizes = []
        send = LeaderChannel.send

        def measured_send(channel, message):
            sizes.append(len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)))
            return send(channel, message)

        LeaderChannel.send = measured_send  # the messages' sizes, on the warm-up run only (never timed)
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            LeaderChannel.send = send
        rounds = []
        for _ in range(args.repeats):
            steps_before = llm.stats()["steps"]
            with timed_methods(LeaderChannel, ["send"]) as totals:
                started = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - started
            steps = llm.stats()["steps"] - steps_before
            rounds.append({"step_ms": 1000 * wall / steps, "send_ms": 1000 * totals["send"]["seconds"] / steps,
                           "messages_per_step": totals["send"]["calls"] / steps})
        result["rounds"] = rounds
        result["message_bytes"] = int(np.median(sizes))
        llm.engine.core.channel.close()  # the follower leaves its loop
    size = int(multihost_utils.broadcast_one_to_all(np.int32(result.get("message_bytes", 0))))
    payload = np.frombuffer(os.urandom(size), np.uint8)
    timings = {}
    for name, send_once in (("broadcast_one_to_all", lambda i: multihost_utils.broadcast_one_to_all(payload)),
                            ("kv_store", lambda i: _kv_round(jax_distributed.global_state.client, process_id,
                                                             payload, i))):
        send_once(-1)
        per_call = []
        for i in range(args.calls):
            started = time.perf_counter()
            send_once(i)
            per_call.append(1000 * (time.perf_counter() - started))
        timings[name] = {"mean_ms": statistics.mean(per_call), "best_ms": min(per_call)}
    multihost_utils.sync_global_devices("done")
    if process_id == 0:
        result["alternatives"] = timings
        print("RESULT " + json.dumps(result), flush=True)


def _kv_round(client, process_id: int, payload: np.ndarray, index: int) -> None:
    """One message through the key-value store: the leader sets it, the follower waits for it."""
    key = f"bench/step/{index}"
    if process_id == 0:
        client.key_value_set_bytes(key, payload.tobytes())
    else:
        client.blocking_key_value_get_bytes(key, 60_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200, help="sends of each alternative")
    parser.add_argument("--worker", nargs=2, metavar=("COORDINATOR", "PROCESS_ID"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{sock.getsockname()[1]}"
    command = [sys.executable, __file__, "--num-requests", str(args.num_requests), "--output-len",
               str(args.output_len), "--repeats", str(args.repeats), "--calls", str(args.calls),
               "--worker", coordinator]
    follower = subprocess.Popen([*command, "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    leader = subprocess.run([*command, "0"], capture_output=True, text=True)
    follower.wait(timeout=120)
    line = next((line for line in leader.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"the leader gave no result:\n{leader.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    rounds = result["rounds"]
    print(f"step channel, {result['message_bytes']} bytes a message, "
          f"{statistics.mean(r['messages_per_step'] for r in rounds):.2f} messages a step")
    for key, label in (("step_ms", "engine step"), ("send_ms", "channel send per step")):
        values = [r[key] for r in rounds]
        print(f"  {label:<24} mean {statistics.mean(values):7.3f} ms   best {min(values):7.3f} ms")
    share = [r["send_ms"] / r["step_ms"] for r in rounds]
    print(f"  {'send / step':<24} mean {100 * statistics.mean(share):6.2f} %    best {100 * min(share):6.2f} %")
    for name, timing in result["alternatives"].items():
        print(f"  {name:<24} mean {timing['mean_ms']:7.3f} ms   best {timing['best_ms']:7.3f} ms  (the same bytes, "
              f"one send)")


if __name__ == "__main__":
    main()
