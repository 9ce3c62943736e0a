"""The EAGLE-3 drafter: dynamic trees from the target's own features, over the head's KV cache.

Draft position p reads the token ``x[p + 1]`` and a feature, and guesses ``x[p + 2]``. For the
positions the target has computed, the feature is the target's (``add_features``: the engine
hands over the hidden states its forwards captured at the head's layers, the prompt's at
prefill and the accepted path's after each verification). A sequence of n tokens whose target
cache holds n - 1 of them therefore feeds its not yet seen positions up to n - 2 as a chain
(the last one reads the root) and gets the first level's logits. Deeper levels are grown by
the model drafter's rules (``growing.TreeGrower``: same beam, selection and sampling), each
node reading its parent's output feature and sitting at rotary position ``n - 2 + depth``, in a
region after the committed positions. Nothing of the tree is kept on commit: the accepted tokens' true features
arrive with the next verification and are fed then, as EAGLE does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.backends import backend_for
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec
from multiguess.engine.drafters.base import Drafter
from multiguess.engine.drafters.growing import Level, TreeGrower
from multiguess.engine.eagle3_head import Eagle3Head
from multiguess.engine.kv_cache import exchange_slots
from multiguess.engine.linear import Projection
from multiguess.engine.memory_plan import Footprint
from multiguess.engine.memory_probe import DraftMemory, MemoryMeter
from multiguess.engine.prefix_cache import swap_keys
from multiguess.engine.tree import TokenTree


class HeadCache:
    """The head's keys and values ``[slots, 2 * kv_heads, capacity, head_dim]``; row = position."""

    def __init__(
        self, num_slots: int, kv_heads: int, capacity: int, dim: int, dtype: torch.dtype, device
    ) -> None:
        self.kv = torch.zeros(num_slots, 2 * kv_heads, capacity, dim, dtype=dtype, device=device)
        self.kv_heads = kv_heads
        self.capacity = capacity

    def move(self, src: int, dst: int, length: int) -> None:
        self.kv[dst, :, :length] = self.kv[src, :, :length]

    def exchange(self, a: int, b: int, length_a: int, length_b: int) -> None:
        exchange_slots(self.kv, a, b, length_a, length_b)

    def truncate(self, slot: int, length: int) -> None:
        """Nothing to give back: a slot's room is its own."""


class HeadRunner:
    """One forward of the head: rows written at their cache rows, attending where a mask says.

    The head's linears run as ``projection``'s fused form: the target's device family's
    (``Backend.projection``), so that on CPUs a level costs the packed kernels' time."""

    def __init__(
        self,
        head: Eagle3Head,
        embed: nn.Module,
        num_slots: int,
        capacity: int,
        projection: type[Projection] = Projection,
    ) -> None:
        head.for_drafting(projection)
        self.head = head
        self.embed = embed
        self.device = head.fc.weight.device
        self.dtype = head.fc.weight.dtype
        self.vocab_size = head.config.vocab_size
        self.head_vocab = head.draft_to_target
        attn_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        c = head.config
        self.cache = HeadCache(num_slots, c.num_key_value_heads, capacity, c.dim, attn_dtype, self.device)
        self.capacity = capacity

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        tokens: torch.Tensor,
        features: torch.Tensor,
        fused: bool,
        positions: torch.Tensor,
        write_from: list[int],
        counts: list[int],
        visible: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits ``[B, T, V']`` and output features ``[B, T, hidden]`` of ``tokens`` and
        ``features`` ``[B, T, ...]`` (the target's unless ``fused``: the head's own). Row i of
        sequence b is written at cache row ``write_from[b] + i`` when ``i < counts[b]`` (others
        are padding) and sees the cache columns ``visible[b, i]`` (``[B, T, L]``)."""
        device, head = self.device, self.head
        length = visible.shape[-1]
        if (
            max(w + n for w, n in zip(write_from, counts, strict=True)) > self.capacity
            or length > self.capacity
        ):
            raise ValueError(f"sequence would exceed the draft cache capacity of {self.capacity} tokens")
        embeds = self.embed(tokens.to(device)).to(self.dtype)
        hidden = features.to(device, self.dtype) if fused else head.fuse(features.to(device))
        q, k, v = head.qkv(embeds, hidden, head.rope(embeds, positions.to(device)))
        kv = self.cache.kv
        new = torch.cat([k, v], dim=1).to(kv.dtype)
        for b, (slot, start, n) in enumerate(zip(slots, write_from, counts, strict=True)):
            kv[slot, :, start : start + n] = new[b, :, :n]
        cached = kv[slots, :, :length]
        heads = self.cache.kv_heads
        mask = torch.zeros(visible.shape, dtype=kv.dtype, device=device)
        mask.masked_fill_(~visible.to(device), float("-inf"))
        attended = F.scaled_dot_product_attention(
            q.to(kv.dtype), cached[:, :heads], cached[:, heads:], attn_mask=mask[:, None], enable_gqa=True
        )
        out = head.finish(attended.to(self.dtype), hidden)
        return head.logits(out).float(), out


def probe_head(
    head: Eagle3Head,
    embed: nn.Module,
    projection: type[Projection],
    meter: MemoryMeter,
    slots: int,
    width: int,
) -> tuple[int, int]:
    """(activation peak, KV bytes per position) of one head forward of ``slots`` chains of
    ``width`` positions on a probe cache sized to them, allocated before the measurement."""
    runner = HeadRunner(head, embed, slots, width, projection)
    per_token = runner.cache.kv.nbytes // (slots * width)
    features = torch.zeros(slots, width, len(head.config.aux_layers) * head.config.target_hidden_size)
    tokens = torch.zeros(slots, width, dtype=torch.long)
    positions = torch.arange(width).expand(slots, width)
    visible = chain_visibility([0] * slots, [0] * slots, [width] * slots, width, width)

    def forward() -> None:
        runner.forward(
            list(range(slots)), tokens, features, False, positions, [0] * slots, [width] * slots, visible
        )

    return meter.peak(runner.device, forward), per_token


def chain_visibility(
    bases: list[int], starts: list[int], counts: list[int], width: int, length: int
) -> torch.Tensor:
    """``[B, width, length]``: row i of sequence b (position ``starts[b] + i``) sees its sequence
    from ``bases[b]`` up to itself; padding rows see column 0 (finite, unused)."""
    cols = torch.arange(length)
    ends = torch.tensor(starts)[:, None] + torch.arange(width)  # [B, W]
    seen = (cols >= torch.tensor(bases)[:, None, None]) & (cols <= ends[..., None])
    padding = torch.arange(width)[None, :] >= torch.tensor(counts)[:, None]
    seen[padding] = cols == 0
    return seen


def tree_visibility(bases: list[int], prefixes: list[int], region: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, W, length]``: committed columns ``[bases[b], prefixes[b])`` and, in the region after
    them, the offsets ``region`` ``[B, W, R]`` marks (a node's ancestors and itself)."""
    batch, width, size = region.shape
    cols = torch.arange(length)
    rel = cols[None, :] - torch.tensor(prefixes)[:, None]  # [B, L]
    committed = (cols[None, :] >= torch.tensor(bases)[:, None]) & (rel < 0)
    in_region = (rel >= 0) & (rel < size)
    picked = region.gather(2, rel.clamp(0, size - 1)[:, None, :].expand(batch, width, length))
    return committed[:, None, :] | (picked & in_region[:, None, :])


class Eagle3Drafter(Drafter):
    """Drafts with an EAGLE-3 ``head`` reading the target's features, by the tree rules of
    ``growing.TreeGrower``; ``embed`` is the head's own token embeddings or the target's.
    ``start`` sizes the head's KV cache; ``wire_exact``: see ``TreeGrower`` (a draft server's)."""

    takes_grafts = True
    prefills = True

    def __init__(self, head: Eagle3Head, embed: nn.Module, wire_exact: bool = False) -> None:
        self.head = head
        self.embed = embed
        self.wire_exact = wire_exact
        self.cached: dict[int, int] = {}  # slot -> positions whose KV the head holds
        self.base: dict[int, int] = {}  # slot -> the first position with features (and KV)
        self.pending: dict[int, torch.Tensor] = {}  # slot -> target features from cached[slot] on
        self._root: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> last row's logits, feature
        self._hidden: list[dict[int, torch.Tensor]] = []  # per request of a proposal: node -> feature

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers (transformers' ``output_hidden_states`` index) the head reads."""
        return tuple(self.head.config.aux_layers)

    @property
    def feature_width(self) -> int:
        """Values per position of the target's features the head reads."""
        return len(self.head.config.aux_layers) * self.head.config.target_hidden_size

    def memory(self) -> DraftMemory:
        """The head's weights (the target's embeddings count once), and the peak and KV bytes
        of a head forward over ``max_batch`` chains as wide as a tree."""

        def measure(meter: MemoryMeter, config: EngineConfig) -> Footprint:
            projection = self._projection(config)
            return Footprint(
                *probe_head(self.head, self.embed, projection, meter, config.max_batch, config.tree_slack)
            )

        return DraftMemory(self.head.fc.weight.device, (self.head, self.embed), measure)

    def start(self, slots: int, capacity: int, config: EngineConfig) -> None:
        """The head's runner and KV cache, its linears in the device family's fused form."""
        self.runner = HeadRunner(self.head, self.embed, slots, capacity, self._projection(config))
        self.grower = TreeGrower(self.runner.head_vocab, self.runner.vocab_size, self.wire_exact)

    def _projection(self, config: EngineConfig) -> type[Projection]:
        weight = self.head.fc.weight
        return backend_for(weight.device, weight.dtype, config.eager, config.backend).projection

    def add_features(self, slot: int, position: int, features: torch.Tensor) -> None:
        """The target's features ``[m, F]`` at positions ``position..position + m - 1`` of the
        sequence in ``slot``. Features that do not continue what the drafter holds (it forgot
        the sequence after a failure) start it afresh from ``position``: positions before it
        stay unseen, which costs acceptance, never correctness."""
        if not len(features):
            return
        held = self.pending.get(slot)
        if slot in self.cached and held is not None and self.cached[slot] + len(held) == position:
            self.pending[slot] = torch.cat([held, features.to(held.device)])
            return
        self.release(slot)
        self.base[slot] = self.cached[slot] = position
        self.pending[slot] = features

    def release(self, slot: int) -> None:
        for state in (self.cached, self.base, self.pending, self._root):
            state.pop(slot, None)

    def retain(self, slot: int, length: int) -> None:
        """Keep the head's cache of the positions fed with the target's features whose tokens
        are among the first ``length`` (position p reads token p + 1)."""
        self._root.pop(slot, None)
        kept = self._reusable(slot, length)
        if not kept:
            self.release(slot)
            return
        self.cached[slot] = kept
        self.pending[slot] = self.pending[slot][:0]

    def share(self, src: int, dst: int, length: int) -> int:
        """The head's cache of ``src``'s positions before ``length - 1`` in ``dst``: the target
        must compute the features from there on (the last prompt position's at least, which
        gives the first level's logits), so that is how many tokens it may skip."""
        kept = self._reusable(src, length)
        empty = self.pending[src][:0] if kept else None
        self.release(dst)
        if not kept:
            return 0
        if src != dst:
            self.runner.cache.move(src, dst, kept)
        self.base[dst], self.cached[dst], self.pending[dst] = 0, kept, empty
        return kept

    def _reusable(self, slot: int, length: int) -> int:
        """How many of ``slot``'s first positions a sequence sharing its first ``length`` tokens
        can keep: fed from position 0 with the target's features, and reading a shared token."""
        if slot not in self.pending or self.base.get(slot) != 0:
            return 0
        return max(0, min(self.cached[slot], length - 1))

    def move(self, src: int, dst: int) -> None:
        """Carry the sequence's head cache along, and what ``dst`` retained back to ``src``."""
        self.runner.cache.exchange(src, dst, self.cached.get(src, 0), self.cached.get(dst, 0))
        for state in (self.cached, self.base, self.pending, self._root):
            swap_keys(state, src, dst)

    def prefill(self, slot: int, token_ids: list[int]) -> None:
        """Feed the target features handed over so far of a prompt being prefilled (position p
        reads token p + 1, so ``token_ids`` runs one past the last feature's position)."""
        held = self.pending.get(slot)
        if held is not None and len(held) and self.cached[slot] + len(held) == len(token_ids) - 1:
            self._feed_chain([slot], [token_ids])

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Trees for the sequences the drafter holds features for; the others (a one-token
        prompt before its first verification, a sequence forgotten after a failure) get their
        root alone until the next verification hands their features over."""
        ready = [r for r in requests if r.slot in self.pending]
        drafted: dict[int, Proposal] = {}
        if ready:
            logits, prefixes = self._catch_up(ready)
            grown = self.grower.grow(ready, logits, prefixes, self._feed)
            drafted = {r.slot: g.proposal for r, g in zip(ready, grown, strict=True)}
        return [drafted.get(r.slot) or Proposal(TokenTree.chain([r.token_ids[-1]])) for r in requests]

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        """Nothing of the tree is kept: its nodes read the head's own features, and the accepted
        ones are fed again with the target's once the verification's features arrive."""

    def _feed_chain(
        self, slots: list[int], token_ids: list[list[int]]
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Feed every sequence's positions from ``cached`` to ``n - 2`` (their target features
        are pending); per sequence the first position fed and the rows' logits and features."""
        starts, counts = [], []
        for slot, ids in zip(slots, token_ids, strict=True):
            held = self.pending.get(slot)
            if held is None or self.cached[slot] + len(held) != len(ids) - 1:
                raise RuntimeError(
                    f"the EAGLE-3 drafter has no target features for slot {slot} up to its root"
                )
            starts.append(self.cached[slot])
            counts.append(len(held))
        width = max(1, max(counts))
        tokens = torch.zeros(len(slots), width, dtype=torch.long)
        device = self.runner.device  # where the captured features already are
        features = torch.zeros(len(slots), width, self.pending[slots[0]].shape[-1], device=device)
        for b, (slot, ids, start, n) in enumerate(zip(slots, token_ids, starts, counts, strict=True)):
            tokens[b, :n] = torch.tensor(ids[start + 1 : start + 1 + n])
            features[b, :n] = self.pending[slot].to(device, torch.float32)
        positions = torch.tensor(starts)[:, None] + torch.arange(width)
        length = max(s + width for s in starts)
        visible = chain_visibility([self.base[s] for s in slots], starts, counts, width, length)
        logits, hidden = self.runner.forward(
            slots, tokens, features, False, positions, starts, counts, visible
        )
        out = []
        for b, (slot, ids, start, n) in enumerate(zip(slots, token_ids, starts, counts, strict=True)):
            self.cached[slot] = len(ids) - 1
            self.pending[slot] = self.pending[slot][:0]
            if n:
                self._root[slot] = (logits[b, n - 1], hidden[b, n - 1])
            out.append((start, logits[b, :n], hidden[b, :n]))
        return out

    def _catch_up(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, list[int]]:
        """Feed each sequence's positions with pending features: the roots' logits, and where
        each sequence's tree region starts (after position ``n - 2``)."""
        self._feed_chain([r.slot for r in requests], [r.token_ids for r in requests])
        roots = [self._root[r.slot] for r in requests]
        self._hidden = [{-1: feature} for _, feature in roots]
        return torch.stack([logits for logits, _ in roots]), [len(r.token_ids) - 1 for r in requests]

    def _feed(self, level: Level) -> list[torch.Tensor]:
        """One head forward over every sequence's beam, each node reading its parent's output
        feature; returns each beam's logits rows."""
        requests, prefixes, beams, cands = level.requests, level.prefixes, level.beams, level.cands
        tokens, depths, used, region = level.place()
        hidden_size = self.runner.head.config.hidden_size
        parents = torch.zeros(
            len(beams), tokens.shape[1], hidden_size, dtype=self.runner.dtype, device=self.runner.device
        )
        for b, beam in enumerate(beams):
            for j, c in enumerate(beam):
                parents[b, j] = self._hidden[b][cands[b][c].parent]
        slots = [r.slot for r in requests]
        lens = torch.tensor(prefixes)[:, None]
        write_from = [p + int(u) for p, u in zip(prefixes, used, strict=True)]
        length = max(prefixes) + region.shape[2]
        visible = tree_visibility([self.base[s] for s in slots], prefixes, region, length)
        counts = [len(beam) for beam in beams]
        logits, hidden = self.runner.forward(
            slots, tokens, parents, True, lens + depths, write_from, counts, visible
        )
        for b, beam in enumerate(beams):
            for j, c in enumerate(beam):
                self._hidden[b][c] = hidden[b, j]
        return [logits[b, : len(beam)] for b, beam in enumerate(beams)]

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None]:
        """Feed the positions whose target features arrived and rank each token they guess for
        the first time (position p guesses ``token_ids[p + 2]``) among the head's ``width``
        guesses (``TreeGrower.ranks``); nothing for a sequence it holds no features for."""
        if slot not in self.pending:
            return []
        ((start, logits, _),) = self._feed_chain([slot], [token_ids])
        first = max(start + 2, since)
        if first >= len(token_ids):
            return []
        return self.grower.ranks(
            logits[first - 2 - start : len(token_ids) - 2 - start], token_ids, first, width, sample
        )
