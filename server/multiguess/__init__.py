"""multiguess: lossless multi-candidate (tree) speculative decoding."""
