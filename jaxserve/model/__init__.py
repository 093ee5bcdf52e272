"""Models: the interface and registry (registry.py), spec parsing, weight loading, sharding rules and the
architectures (the Llama family: llama.py)."""
