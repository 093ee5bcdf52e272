"""One process of a two-process launch (tests/test_multihost.py): `python multihost_worker.py COORDINATOR
PROCESS_ID HTTP_PORT`, two simulated CPU devices each, together a tensor-parallel mesh of 4 on the llama fixture.

Both build `LLM` (on the follower it serves the leader's steps, then ends the process). The leader generates
offline, updates the weights to those of the folder JAXSERVE_TEST_NEW_WEIGHTS names and generates again, goes back
to the fixture's weights, prints one `OFFLINE {json}` line, then serves HTTP on the same engine until it is
stopped.
"""

import json
import os
import sys

from helpers import FAST_COMPILE_XLA_FLAG, checkpoint, expected, small_engine_args

ENGINE = small_engine_args(max_model_len=96, max_num_batched_tokens=32, max_num_seqs=16, num_pages=24,
                          skip_precompile=True)
GREEDY = dict(temperature=0, max_tokens=20, ignore_eos=True)
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


def main(coordinator: str, process_id: int, http_port: int) -> None:
    import uvicorn

    from jaxserve import LLM, SamplingParams
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig

    llm = LLM(checkpoint("llama"), tensor_parallel_size=4, distributed_coordinator=coordinator, num_processes=2,
              process_id=process_id, distributed_timeout_s=240, **ENGINE)
    prompts = expected("llama")["prompts"]
    greedy = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    sampled = llm.generate(prompts[:4], SamplingParams(**SAMPLED), use_tqdm=False)
    llm.update_weights(os.environ["JAXSERVE_TEST_NEW_WEIGHTS"])  # every process reads its shards of them
    updated = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    llm.update_weights(checkpoint("llama"))  # the fixture's weights again, for the server tests
    print("OFFLINE " + json.dumps({"greedy": [o.outputs[0].token_ids for o in greedy],
                                   "sampled": [o.outputs[0].token_ids for o in sampled],
                                   "updated": [o.outputs[0].token_ids for o in updated]}), flush=True)
    uvicorn.run(build_app(llm.engine, ServerConfig(served_model_name="llama")), host="127.0.0.1", port=http_port,
                log_level="warning")


if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {FAST_COMPILE_XLA_FLAG}"
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
