"""One runner interface, a backend per device family.

``NativeRunner`` (``engine/runner.py``) owns what every device shares: the model's parts, the
KV cache, rotary positions, the region mask and the LM head. A backend owns what differs by
device family: the cache's dtype, how projections keep their weights, the attention mask's
form and how a forward runs every decoder layer. Nothing above the runner asks which device
it is on.

- ``cpu``: prepacked weights (multiguess's bf16 panels on huge pages, or oneDNN), whole layers
  in multiguess's bf16 or quantized layer kernels where they apply, fp32 attention over a bf16
  cache there (every key and value they write is a bf16 value) and over an fp32 cache in torch.
- ``torch`` (CUDA and any other torch device): the model's dtype end to end, attention without
  a dense mask where causality or a plain decode suffices (so fused flash kernels apply), CUDA
  graphs on request (``backends/cuda/graphs.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from multiguess.engine.linear import Projection
from multiguess.engine.placement import Placement

if TYPE_CHECKING:
    from multiguess.engine.backends.cuda.graphs import StaticForward
    from multiguess.engine.backends.parts import ModelParts

BACKENDS = ("auto", "cpu", "torch")


class Backend(Protocol):
    name: str
    label: str  # which kernels run, as benchmarks report it
    attn_dtype: torch.dtype  # attention's dtype (and the KV cache's unless ``kv_dtype`` says otherwise)
    projection: type[Projection]  # how fused projections keep their weights
    cost_tokens: int  # how many tokens the forward-cost curve is measured up to, at least
    attends_unmasked: bool  # whether forwards that see only their own prefix go without a mask
    pages_kv: bool  # whether its runners keep KV in blocks (``paged_kv.py``) rather than slots
    # Whether a step accepts its whole batch in tensor ops on the device, read back once
    # (``engine/batch_acceptance.py``), or node by node on the host with the family's kernels.
    batched_acceptance: bool
    # Whether every row of a forward is computed alone (per-row kernels), so a batch of trees of
    # different sizes may be verified a node per row, without padding (``NativeRunner.forward_trees``).
    ragged_rows: bool

    def kv_dtype(self, runner: ModelParts) -> torch.dtype:
        """The KV cache's dtype for ``runner``'s layers, once it has built its projections."""

    def attach(self, runner: ModelParts) -> None:
        """Prepare per-model state once the runner has built its projections and cache."""

    def mask(self, visible: torch.Tensor, plain: bool) -> torch.Tensor | None:
        """The attention mask from the bool region mask ``[B, 1, T, L]``; ``plain`` when every row
        sees exactly its own prefix and itself (one token per sequence, or a chain from 0)."""

    def run_layers(self, runner: ModelParts, x: torch.Tensor, at: Placement) -> torch.Tensor:
        """Every decoder layer on ``x`` ``[B, T, D]``, writing keys and values into the cache."""

    def static_forward(self, runner: ModelParts, max_width: int) -> StaticForward:
        """Decode and verification forwards of up to ``max_width`` nodes over bucketed static
        shapes (CUDA graphs where captured); a family without them refuses with a ValueError."""


def backend_for(device: torch.device, dtype: torch.dtype, eager: bool, name: str = "auto") -> Backend:
    """``auto``: the CPU backend on CPUs, the torch backend on every other device."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        from multiguess.engine.backends.cpu.backend import CpuBackend

        return CpuBackend(dtype, eager)
    from multiguess.engine.backends.cuda.backend import TorchBackend

    return TorchBackend(dtype)


def cpu_has_fast_bf16() -> bool:
    """True where bf16 beats fp32 on this CPU: where multiguess's bf16 kernels run (AVX512-BF16,
    AMX, or AVX2 with FMA: they stream half the bytes fp32 does) or oneDNN has bf16 instructions."""
    from multiguess.engine.backends.cpu import bf16_kernel
    from multiguess.engine.backends.cpu.packed import onednn_bf16

    return bf16_kernel.library() is not None or onednn_bf16()


class SamplingKernels(Protocol):
    """A device family's own kernels for drawing from rows of logits (``engine/sampling.py``
    names the rule each follows); each answers None where it cannot serve the row."""

    def seeded_argmax(self, logits: torch.Tensor, temperature: float, key: int) -> int | None: ...

    def kept_set(
        self, logits: torch.Tensor, temperature: float, top_k: int, top_p: float, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def kept_race(self, ids: torch.Tensor, probs: torch.Tensor, key: int) -> int | None: ...


def sampling_kernels(device: torch.device) -> SamplingKernels | None:
    """The device family's own kernels for drawing from a row of logits, or None where it has
    none (``engine/sampling.py`` then scores rows with torch). The CPU family's are C kernels
    that still answer None where their library did not build."""
    if device.type != "cpu":
        return None
    from multiguess.engine.backends.cpu import bf16_kernel

    return bf16_kernel
