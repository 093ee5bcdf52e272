"""Llama-family models: spec parsing, weight loading, sharding rules and the pure forward pass."""
