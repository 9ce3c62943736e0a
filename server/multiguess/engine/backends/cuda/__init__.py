"""The torch/CUDA family: the model's dtype end to end, fused attention, CUDA graphs."""
