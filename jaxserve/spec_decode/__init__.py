"""Speculative decoding: proposers guess a request's next tokens cheaply (ngram.py); the target model checks
every guess in one forward pass and keeps an exact sample of its own distribution (verify.py)."""
