"""The OpenAI-compatible HTTP server (needs the `serve` extra: fastapi, uvicorn, prometheus-client)."""
