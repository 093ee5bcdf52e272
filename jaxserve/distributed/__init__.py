"""Beyond one process: multi-host engines on JAX's distributed runtime (runtime.py, channel.py, mirror.py) and
data-parallel replicas behind one front end (replicas.py)."""
