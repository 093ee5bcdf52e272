"""Pooling (embeddings): a request whose prompt runs through the model and comes back as one vector, pooled
from the final hidden states of its prompt tokens (params.py: what a request and the engine ask for;
pooled.py: a request's running pool)."""
