"""The steps of benchmarks/gpu_check.sh, one module each, each run in its own process by `python -m benchmarks.gpu`.

env (1), compiles (2), checks (3), bandwidth (4), decode (5), fallback (6), prefill (7), kv_write (8), fp8 (9),
profile (10: where an engine step's time goes), hf_peer (11: Hugging Face on the same GPU), e2e (12), summary
(13: the table, the headline figures and the decision). config.py holds the H200 plan and its tiny CPU twin;
step.py a step's context and the results the steps keep (no jax); common.py what the measuring steps share
(timing, random pools).
"""
