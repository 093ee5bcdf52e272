"""The engine: the scheduler (no jax), the engine core that runs its steps, the offline LLM and the
async engine the server drives, output processing and detokenization."""
