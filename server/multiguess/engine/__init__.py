"""The speculative decoding engine: token trees, drafters, acceptance, KV caches, the step loop."""
