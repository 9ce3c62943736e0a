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

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from multiguess.engine.backends import torch_layers
from multiguess.engine.backends.cuda.attention import attention
from multiguess.engine.linear import rms_norm
from multiguess.engine.one_copy import Packed
from multiguess.engine.placement import Placement, region_attention_mask

if TYPE_CHECKING:
    from multiguess.engine.backends.parts import ModelParts

log = logging.getLogger(__name__)

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_WIDTH = 128
MIN_SPAN = 256
# Region columns a graph row may see beyond its own forward's nodes: a drafter's earlier levels.
REGION_SLACK = 64


def bucket(n: int, sizes: tuple[int, ...], limit: int) -> int | None:
    """The smallest of ``sizes`` (and ``limit`` itself) that holds ``n``, at most ``limit``."""
    return next((s for s in (*sizes, limit) if n <= s <= limit), None)


def powers_of_two(start: int, limit: int) -> tuple[int, ...]:
    """``start``, twice that, … up to ``limit`` (``start`` a power of two)."""
    return tuple(2**i for i in range(start.bit_length() - 1, limit.bit_length() + 1) if 2**i <= limit)


class _Graph:
    """One bucket's static inputs, its (on CUDA) captured graph, and its logits: a view of the
    buffer every graph of the runner shares (``StaticForward.logits``), which one forward at a
    time fills. The mask is made inside the graph from the row lengths and each row's
    visibility over its region (``region_attention_mask``), so a replay copies those, not a
    dense ``[B, T, span]`` mask."""

    def __init__(
        self, runner: ModelParts, batch: int, width: int, span: int, last_only: bool, logits: torch.Tensor
    ) -> None:
        device = runner.device
        self.tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)
        self.write_slots = torch.zeros(batch, dtype=torch.long, device=device)
        self.visible = torch.zeros(batch, width, width + REGION_SLACK, dtype=torch.bool, device=device)
        self.logits_at = torch.zeros(batch, dtype=torch.long, device=device) if last_only else None
        self.columns = torch.arange(width, device=device)
        self.region_columns = torch.arange(width + REGION_SLACK, device=device)
        self.rows = torch.arange(batch, device=device)
        self.span = span
        self.runner = runner
        self.graph: torch.cuda.CUDAGraph | None = None
        vocab = logit_columns(runner)
        shape = (batch, vocab) if last_only else (batch, width, vocab)
        self.out = logits.view(-1)[: math.prod(shape)].view(shape)

    @property
    def region(self) -> int:
        return self.visible.shape[-1]

    def _body(self) -> torch.Tensor:
        r = self.runner
        batch = self.tokens.shape[0]
        x = r.embed(self.tokens).to(r.dtype)
        heads = torch.arange(2 * r.num_kv_heads, device=r.device)
        where = (
            self.write_slots[:, None, None],
            heads[None, :, None],
            (self.starts[:, None] + self.columns)[:, None, :],
        )
        mask = region_attention_mask(self.lens, self.visible, self.span)
        at = Placement(r.rope(x, self.positions), list(range(batch)), self.starts, mask, self.span)
        for i in range(len(r.layers)):
            q = torch_layers.queries_writing_cache(r, i, x, at.rope, where)
            keys, values = r.cache.read(i, slice(0, batch), self.span)
            out = attention(q, keys, values, mask, r.attention_scale(i)).to(r.dtype)
            o = r.o[i]
            x = x + r.layers[i].self_attn.o_proj(out) if o is None else o(out, residual=x)
            x = torch_layers.mlp(r, i, x)
        if self.logits_at is not None:
            x = x[self.rows, self.logits_at]
        logits = r.lm_head(rms_norm(r.norm, x)) if r.head is None else r.head(x, norm=r.norm)
        return self.out.copy_(logits)

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
            self._body()

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self._body()
        self.graph.replay()
        return self.out

    def fill(self, n: int, inputs: list[torch.Tensor], scratch_slot: int) -> None:
        """The buffers from one forward's inputs on the device (``StaticForward.run``): rows
        ``0..n-1`` from ``inputs`` (none when ``n`` is 0), the rest padding rows, which write to
        ``scratch_slot``; every padding row and node sees only its own position."""
        for buffer in (self.tokens, self.starts, self.lens, self.visible):
            buffer.zero_()
        width = 0
        if n:
            tokens, positions, starts, lens, visible = inputs[:5]
            width, region = visible.shape[1], visible.shape[2]
            self.tokens[:n, :width] = tokens
            self.starts[:n] = starts
            self.lens[:n] = lens
            self.visible[:n, :width, :region] = visible
        self.positions.copy_(self.starts[:, None] + self.columns)
        if n:
            self.positions[:n, :width] = positions
        self.write_slots.copy_(torch.where(self.rows < n, self.rows, scratch_slot))
        padding = (self.rows[:, None] >= n) | (self.columns[None, :] >= width)
        own = (self.starts - self.lens)[:, None] + self.columns  # each node's column in its region
        self.visible |= (self.region_columns[None, None, :] == own[..., None]) & padding[..., None]
        if self.logits_at is not None:
            self.logits_at.zero_()
            if n:
                self.logits_at[:n] = inputs[5]


class StaticForward:
    """The runner's forwards through bucketed static shapes, captured as CUDA graphs on CUDA.

    On CUDA every bucket up to ``max_width`` nodes, the cache's slots and its capacity is
    captured at construction (``prepare``), so serving never stops to capture; a forward that
    fits none runs eagerly. Elsewhere buckets are built as forwards meet them, uncaptured.
    All graphs write their logits into one buffer, sized for the largest."""

    def __init__(self, runner: ModelParts, max_width: int = MAX_WIDTH) -> None:
        self.runner = runner
        self.widths = tuple(sorted({*powers_of_two(1, max_width), max_width}))
        self.spans = powers_of_two(MIN_SPAN, runner.capacity)
        self.batches = (*(b for b in BATCHES if b < runner.cache.num_slots), runner.cache.num_slots)
        self.capture = runner.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.logits = torch.empty(
            self.batches[-1] * self.widths[-1] * logit_columns(runner),
            dtype=torch.float32,
            device=runner.device,
        )
        self.graphs: dict[tuple[int, int, int, bool], _Graph] = {}
        if self.capture:
            self.prepare()

    def prepare(self) -> None:
        """Capture every bucket of decode and verification forwards, and log the time it took."""
        started = time.perf_counter()
        for span in self.spans:
            for batch in self.batches:
                for width in self.widths:
                    self._graph((batch, width, span, False))
        log.info(
            "captured %d CUDA graphs (batches %s, widths %s, spans %s) in %.1f s",
            len(self.graphs),
            list(self.batches),
            list(self.widths),
            list(self.spans),
            time.perf_counter() - started,
        )

    def _graph(self, key: tuple[int, int, int, bool]) -> _Graph:
        graph = self.graphs.get(key)
        if graph is None:
            graph = _Graph(self.runner, *key, self.logits)
            graph.fill(0, [], self.runner.cache.scratch_slot)  # every row a padding row
            if self.capture:
                graph.capture(self.pool)
            self.graphs[key] = graph
        return graph

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
        """The forward's logits, or None where it fits no bucket (run it eagerly). Its inputs
        (host tensors) go to the device in one copy; the graph's buffers are filled there."""
        r = self.runner
        n, width = tokens.shape
        rows = sorted(range(n), key=slots.__getitem__)
        if [slots[i] for i in rows] != list(range(n)):
            return None
        batch = bucket(n, self.batches, r.cache.num_slots)
        padded = bucket(width, self.widths, self.widths[-1])
        if batch is None or padded is None:
            return None
        lens = torch.tensor(prefix_lens)
        used = int((write_from.cpu() - lens).max())  # region rows earlier forwards wrote (a drafter's)
        span = bucket(max(length, int(write_from.max()) + padded), self.spans, r.capacity)
        if span is None or max(visible.shape[2], used + padded) > padded + REGION_SLACK:
            return None
        key = (batch, padded, span, logits_at is not None)
        if self.capture and key not in self.graphs:
            return None  # not captured at start: eager, never a capture mid-serving
        graph = self._graph(key)
        order = torch.tensor(rows)
        pack = Packed()
        for part in (tokens, positions, write_from, lens, visible):
            pack.add(part.cpu()[order])
        if logits_at is not None:
            pack.add(logits_at.cpu()[order])
        in_order = rows == list(range(n))
        if not in_order:
            pack.add(order.argsort())
        sent = pack.send(r.device)
        graph.fill(n, sent, r.cache.scratch_slot)
        out = graph.replay()[:n]
        if not in_order:
            out = out[sent[-1]]
        return (out if logits_at is not None else out[:, :width]).clone()


def logit_columns(runner: ModelParts) -> int:
    """The logits' width: the vocabulary, or the tokens a subset head scores."""
    return runner.vocab_size if runner.head_vocab is None else len(runner.head_vocab)
