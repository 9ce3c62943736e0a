"""The weights' huge-page block: aligned, equal copies, placed once per model."""

from __future__ import annotations

from pathlib import Path

import torch
from multiguess.engine.backends.cpu import huge_pages
from multiguess.engine.runner import NativeRunner
from multiguess.models.loading import load_model

from tests.engine.test_bf16_kernels import needs_kernel


def test_copies_are_equal_back_to_back_and_the_block_starts_on_a_huge_page() -> None:
    tensors = [torch.randn(3, 5).to(torch.bfloat16), torch.arange(7, dtype=torch.int64), torch.randn(64, 33)]
    copies = huge_pages.together(tensors)
    assert all(torch.equal(c, t) and c.dtype == t.dtype for c, t in zip(copies, tensors, strict=True))
    starts = [c.data_ptr() for c in copies]
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    assert [s - starts[0] for s in starts] == [0, 64, 128]  # 30 and 56 bytes, each to a cache line
    tensors[0].zero_()
    assert not torch.equal(copies[0], tensors[0])  # copies, not views


@needs_kernel
def test_panels_move_once_and_runners_over_one_model_share_them(gqa_pair: tuple[Path, Path]) -> None:
    """A second runner over the same model must not move panels the first one's layer structs
    point at."""
    loaded = load_model(str(gqa_pair[0]), dtype="bfloat16")
    first = NativeRunner(loaded, 1, 64)
    panels = [p.panels for p in (*first.qkv, *first.o, *first.gate_up, *first.down, first.head)]
    assert all(p is not None for p in panels)
    base = panels[0].data_ptr()  # type: ignore[union-attr]
    assert base % huge_pages.HUGE_PAGE == 0
    assert all(0 <= p.data_ptr() - base < 2**31 for p in panels)  # type: ignore[union-attr]  # one block
    second = NativeRunner(loaded, 1, 64)
    again = [p.panels for p in (*second.qkv, *second.o, *second.gate_up, *second.down, second.head)]
    assert all(p is q for p, q in zip(again, panels, strict=True))
    assert [w.qkv for w in second.backend.layer_weights] == [w.qkv for w in first.backend.layer_weights]
