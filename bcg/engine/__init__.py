"""The serving engine: requests, scheduling, the paged KV cache's blocks, and `LLM`."""
