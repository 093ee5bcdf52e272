"""Structured output: constraints a request sets on its output (a JSON schema, a regex, a choice, a grammar, a
structural tag), compiled by the grammar engine into per-step token masks (grammar.py)."""
