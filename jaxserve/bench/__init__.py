"""`jaxserve bench`: side-by-side benchmarks of jaxserve and its peers on the same weights and prompts.

`throughput` (offline.py) runs one workload through several systems in turn; `serve` (online.py) sends
timed streaming requests to a running OpenAI-compatible server. Both draw their workloads from
workloads.py and their arithmetic from stats.py.
"""
