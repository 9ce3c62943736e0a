"""The CPU family: multiguess's bf16 kernels, repacked weights, huge pages, fp32 attention."""
