"""Beyond one process: multi-host engines on JAX's distributed runtime (runtime.py, channel.py, mirror.py)."""
