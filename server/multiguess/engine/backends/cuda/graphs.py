"""CUDA graphs for the decode and verification forwards: captured once per shape, replayed.

A GPU forward of a small batch is bound by launching its ~10 kernels per layer, not by the GPU.
A graph records one forward over static buffers and replays it with one launch. Shapes are
bucketed: the batch to the next of ``BATCHES`` (rows placed at their cache slots, so the batch
must hold slots 0..n-1, as the engine keeps them), the node count to the next power of two, and
the attended cache span to the next power of two from ``MIN_SPAN`` (a bool mask hides what lies
past each sequence), so a handful of graphs serves every context length. Padding rows write into the cache's scratch slot (never into a free slot:
those keep finished sequences' prefixes for reuse) and see only their own position; padding
nodes of a real row write past its tree, where nothing reads before it is written again.

``StaticForward.run`` returns None where a forward does not fit a bucket (a long prefill, slots
that are not 0..n-1): the runner then runs it eagerly. On devices without CUDA graphs the same
static forward runs uncaptured, so its arithmetic is tested on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from multiguess.engine.backends import torch_layers
from multiguess.engine.backends.cuda.attention import attention
from multiguess.engine.linear import rms_norm
from multiguess.engine.placement import Placement, region_attention_mask, rotary_tables

if TYPE_CHECKING:
    from multiguess.engine.backends.parts import ModelParts

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_WIDTH = 128
MIN_SPAN = 256


def bucket(n: int, sizes: tuple[int, ...], limit: int) -> int | None:
    """The smallest of ``sizes`` (and ``limit`` itself) that holds ``n``, at most ``limit``."""
    return next((s for s in (*sizes, limit) if n <= s <= limit), None)


def powers_of_two(start: int, limit: int) -> tuple[int, ...]:
    """``start``, twice that, … up to ``limit`` (``start`` a power of two)."""
    return tuple(2**i for i in range(start.bit_length() - 1, limit.bit_length() + 1) if 2**i <= limit)


class _Graph:
    """One bucket's static inputs, outputs and (on CUDA) its captured graph."""

    def __init__(self, runner: ModelParts, batch: int, width: int, span: int, last_only: bool) -> None:
        device = runner.device
        self.tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)
        self.write_slots = torch.zeros(batch, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, 1, width, span, dtype=torch.bool, device=device)
        self.logits_at = torch.zeros(batch, dtype=torch.long, device=device) if last_only else None
        self.runner = runner
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def _body(self) -> torch.Tensor:
        r = self.runner
        batch, width = self.tokens.shape
        x = r.embed(self.tokens).to(r.dtype)
        cos, sin = r.rotary(x, self.positions)
        rows = torch.arange(batch, device=r.device)
        heads = torch.arange(2 * r.num_kv_heads, device=r.device)
        where = (
            self.write_slots[:, None, None],
            heads[None, :, None],
            (self.starts[:, None] + torch.arange(width, device=r.device))[:, None, :],
        )
        span = self.mask.shape[-1]
        at = Placement(rotary_tables(cos, sin), list(range(batch)), self.starts, self.mask, span)
        for i in range(len(r.layers)):
            q = torch_layers.queries_writing_cache(r, i, x, at.rope, where)
            keys, values = r.cache.read(i, slice(0, batch), span)
            out = attention(q, keys, values, self.mask, r.attention_scale(i)).to(r.dtype)
            o = r.o[i]
            x = x + r.layers[i].self_attn.o_proj(out) if o is None else o(out, residual=x)
            x = torch_layers.mlp(r, i, x)
        if self.logits_at is not None:
            x = x[rows, self.logits_at]
        if r.head is None:
            return r.lm_head(rms_norm(r.norm, x)).float()
        return r.head(x, norm=r.norm).float()

    def capture(self, pool: object) -> None:
        """Record the forward of the inputs in the buffers, after one uncaptured run of it (which
        writes the cache as the replay will again: the same values at the same places)."""
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            self._body()  # allocations and autotuning outside the graph
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self._body()

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self._body()
        self.graph.replay()
        return self.out


class StaticForward:
    """The runner's forwards through bucketed static shapes, captured as CUDA graphs on CUDA."""

    def __init__(self, runner: ModelParts, max_width: int = MAX_WIDTH) -> None:
        self.runner = runner
        self.widths = powers_of_two(1, max_width)
        self.spans = powers_of_two(MIN_SPAN, runner.capacity)
        self.capture = runner.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[tuple[int, int, int, bool], _Graph] = {}

    def run(
        self,
        slots: list[int],
        prefix_lens: list[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_from: torch.Tensor,
        visible: torch.Tensor,
        logits_at: torch.Tensor | None,
        length: int,
    ) -> torch.Tensor | None:
        """The forward's logits, or None where it fits no bucket (run it eagerly)."""
        r = self.runner
        n, width = tokens.shape
        rows = sorted(range(n), key=slots.__getitem__)
        if [slots[i] for i in rows] != list(range(n)):
            return None
        batch = bucket(n, BATCHES, r.cache.num_slots)
        padded = bucket(width, self.widths, self.widths[-1])
        if batch is None or padded is None:
            return None
        span = bucket(max(length, int(write_from.max()) + padded), self.spans, r.capacity)
        if span is None:
            return None
        key = (batch, padded, span, logits_at is not None)
        graph = self.graphs.get(key) or _Graph(self.runner, batch, padded, span, logits_at is not None)
        self._fill(graph, rows, prefix_lens, tokens, positions, write_from, visible, logits_at, length)
        if key not in self.graphs:
            if self.capture:
                graph.capture(self.pool)
            self.graphs[key] = graph
        out = graph.replay()[:n]
        order = torch.tensor(rows, device=out.device).argsort()
        out = out[order]
        return (out if logits_at is not None else out[:, :width]).clone()

    def _fill(
        self,
        graph: _Graph,
        rows: list[int],
        prefix_lens: list[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_from: torch.Tensor,
        visible: torch.Tensor,
        logits_at: torch.Tensor | None,
        length: int,
    ) -> None:
        """Copy one forward's inputs into the graph's buffers (rows in slot order), padding rows
        and nodes that see only themselves."""
        n, width = tokens.shape
        batch, padded = graph.tokens.shape
        span = graph.mask.shape[-1]
        order = torch.tensor(rows)
        tokens, positions, write_from, visible = (t.cpu() for t in (tokens, positions, write_from, visible))
        starts = torch.zeros(batch, dtype=torch.long)
        starts[:n] = write_from[order]
        write_slots = torch.full((batch,), self.runner.cache.scratch_slot, dtype=torch.long)
        write_slots[:n] = torch.arange(n)
        mask = torch.zeros(batch, 1, padded, span, dtype=torch.bool)
        lens = torch.tensor(prefix_lens)[order]
        mask[:n, :, :width, :length] = region_attention_mask(lens, visible[order], length)
        own = starts[:, None] + torch.arange(padded)
        pad_rows = torch.ones(batch, padded, dtype=torch.bool)
        pad_rows[:n, :width] = False
        b_idx, j_idx = pad_rows.nonzero(as_tuple=True)
        mask[b_idx, 0, j_idx, own[b_idx, j_idx]] = True
        host_tokens = torch.zeros(batch, padded, dtype=torch.long)
        host_tokens[:n, :width] = tokens[order]
        host_positions = own.clone()
        host_positions[:n, :width] = positions[order]
        graph.tokens.copy_(host_tokens)
        graph.positions.copy_(host_positions)
        graph.starts.copy_(starts)
        graph.write_slots.copy_(write_slots)
        graph.mask.copy_(mask)
        if graph.logits_at is not None and logits_at is not None:
            at = torch.zeros(batch, dtype=torch.long)
            at[:n] = logits_at.cpu()[order]
            graph.logits_at.copy_(at)
