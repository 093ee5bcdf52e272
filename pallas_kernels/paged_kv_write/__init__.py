"""Writing a step's new K/V into their pages of the pool, in place."""
