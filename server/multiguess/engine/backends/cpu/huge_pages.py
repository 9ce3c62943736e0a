"""One block of memory on 2 MB pages for the weights a decode step streams.

A decode step reads every weight once, ~270 MB for the embedded target in bf16. On 4 KB pages
that is ~66,000 page-table walks per step, and the hardware prefetchers stop at each 4 KB
boundary. Copied into one anonymous mapping that the kernel is asked to back with transparent
huge pages (``madvise(MADV_HUGEPAGE)``, which the default ``madvise`` setting honours), batched
bf16 decode steps take less time and a single sequence's no more (measured in docs/ENGINE.md).
Where the kernel has no transparent huge pages the block is ordinary memory and nothing else
changes.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line, which the kernels' vector loads assume at most


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def block(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed bytes starting on a 2 MB boundary, advised onto huge pages."""
    # Private: shared anonymous memory is shmem, whose huge pages are a separate switch (off).
    mapping = mmap.mmap(-1, _round_up(nbytes, HUGE_PAGE) + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start : start + nbytes]


def together(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous ``tensors``, back to back in one ``block``."""
    if not tensors:
        return []
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + _round_up(size, ALIGN))
    memory = block(offsets[-1] + sizes[-1])
    copies = []
    for tensor, offset, size in zip(tensors, offsets, sizes, strict=True):
        copy = memory[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        copies.append(copy.copy_(tensor))
    return copies
