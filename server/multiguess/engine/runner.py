"""The native forward pass: a transformers model's own weights, driven over a static KV cache.

transformers' generic forward spends most of a decode step in framework overhead and has no
notion of writing a token tree into a pre-allocated cache. The supported families share one
layer layout, so this module drives the model's own weights and submodules (embedding, rotary
embedding, norms, LM head) directly and places a batch of token trees, each after its
sequence's prefix, attending to prefix + its own ancestors, in one forward. What differs by
device family (cache dtype, weight layout, attention, kernels) is the backend's
(``engine/backends``); this runner is the one interface the engine and drafters call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from multiguess.engine.backends import backend_for
from multiguess.engine.kv_cache import KVCache, StaticKVCache
from multiguess.engine.linear import rms_norm
from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.paged_kv import PagedKVCache
from multiguess.engine.placement import Placement, Rope, region_attention_mask, sees_only_its_own
from multiguess.engine.tree import TokenTree, pack_trees


class Captured(NamedTuple):
    """A forward's logits and the hidden states it captured: ``[B, T, len(layers) * D]``, the
    states entering each requested layer, concatenated in the order asked."""

    logits: torch.Tensor
    features: torch.Tensor


class NativeRunner:
    """Runs one model over its own static KV cache (one slot per sequence).

    q/k/v and gate/up projections run fused; ``eager`` keeps plain products (no repacked
    weights, no kernels of multiguess's own): the escape hatch. ``backend`` names a device
    family's backend (``auto``: the device's own). ``cuda_graphs`` runs decode and verification
    forwards of up to ``graph_width`` nodes through bucketed static shapes (``backends/cuda/graphs.py``),
    captured on CUDA.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_slots: int,
        capacity: int,
        eager: bool = False,
        head_vocab: torch.Tensor | None = None,
        backend: str = "auto",
        cuda_graphs: bool = False,
        kv_blocks: int | None = None,
        graph_width: int = 128,
    ) -> None:
        model = loaded.model
        config = model.config
        self.model = model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.vocab_size = config.vocab_size
        self.layers = list(model.model.layers)
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.silu_gated = getattr(config, "hidden_act", None) in ("silu", "swish")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.capacity = capacity
        self.backend = backend_for(self.device, self.dtype, eager, backend)
        self.attn_dtype = self.backend.attn_dtype
        self.rope = Rope(model.model.rotary_emb, capacity, self.dtype, self.device)
        projection = self.backend.projection
        self.qkv = [
            projection.of([la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj])
            for la in self.layers
        ]
        self.o = [projection.of([la.self_attn.o_proj]) for la in self.layers]
        self.gate_up = [projection.of([la.mlp.gate_proj, la.mlp.up_proj]) for la in self.layers]
        self.down = [projection.of([la.mlp.down_proj]) for la in self.layers]
        self.head = projection.of([self.lm_head])
        # Scoring only ``head_vocab`` (a draft's vocabulary, models/draft_vocab.py): logit column
        # j is token head_vocab[j]. Needs a plain Linear head: a quantized one scores every token.
        self.head_vocab = None
        if head_vocab is not None and (subset := projection.rows(self.lm_head, head_vocab)):
            self.head, self.head_vocab = subset, head_vocab.to(self.device)
        self.cache = self._cache(num_slots, capacity, cuda_graphs, kv_blocks)
        self.backend.attach(self)
        self.static = self.backend.static_forward(self, graph_width) if cuda_graphs else None

    def _cache(self, num_slots: int, capacity: int, cuda_graphs: bool, kv_blocks: int | None) -> KVCache:
        """Paged where the backend reads pages (``kv_blocks`` in its pool; None: every slot's
        whole capacity), else static slots (the CPU's layer kernels read the slot layout; CUDA
        graphs' buffers index slots, with a scratch slot for padding rows)."""
        shape = (len(self.layers), num_slots, self.num_kv_heads, capacity, self.head_dim)
        dtype = self.backend.kv_dtype(self)
        if self.backend.pages_kv and not cuda_graphs:
            return PagedKVCache(*shape, dtype, self.device, num_blocks=kv_blocks)
        return StaticKVCache(*shape, dtype, self.device, scratch_slots=1 if cuda_graphs else 0)

    def attention_scale(self, i: int) -> float:
        return getattr(self.layers[i].self_attn, "scaling", None) or self.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        prefix_lens: list[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_from: torch.Tensor,
        visible: torch.Tensor,
        logits_at: torch.Tensor | None = None,
        capture: tuple[int, ...] = (),
        scored_rows: int | None = None,
    ) -> torch.Tensor | Captured:
        """Write a batch of token-tree nodes into the caches and return float32 logits.

        ``tokens`` and ``positions`` (rotary) are ``[B, T]``; row b is written to the cache at
        ``write_from[b] + 0..T-1``; ``visible`` is ``[B, T, W]`` over the region after each
        prefix (see ``region_attention_mask``). Logits are for every node ``[B, T, V]``, or for the
        ``logits_at`` column of each row only ``[B, V]`` (a prefill needs just the last one); V
        is the vocabulary, or ``head_vocab`` when the runner scores only that; with
        ``scored_rows``, for the first that many rows only (the others' logits are not needed:
        the head is a large product). With ``capture``
        (layer indices, transformers' ``output_hidden_states`` numbering) the result is
        ``Captured``: the logits and the hidden states entering those layers at every node,
        copied as the layers run; without it nothing is copied.
        """
        batch, width = tokens.shape
        device = self.device
        # Past every entry written: all a row may see (nothing after it is written yet), and all
        # a backend attending each row alone over its mask reads. Rows padded together attend over
        # the whole region after the longest prefix too.
        length = int(write_from.max()) + width
        if not self.backend.ragged_rows:
            length = max(length, max(prefix_lens) + visible.shape[2])
        if length > self.capacity:
            raise ValueError(f"sequence would exceed the cache capacity of {self.capacity} tokens")
        if self.static is not None and not capture:
            out = self.static.run(
                slots, prefix_lens, tokens, positions, write_from, visible, logits_at, length
            )
            if out is not None:
                return out
        plain = self.backend.attends_unmasked and sees_only_its_own(prefix_lens, write_from, visible, length)
        visible_mask = region_attention_mask(
            torch.tensor(prefix_lens, device=device), visible.to(device), length
        )
        x = self.embed(tokens.to(device)).to(self.dtype)
        captured = dict.fromkeys(capture) if capture else None
        at = Placement(
            self.rope(x, positions.to(device)),
            slots,
            write_from,
            self.backend.mask(visible_mask, plain),
            length,
            captured,
        )
        x = self.backend.run_layers(self, x, at)
        if logits_at is not None:  # the norm is per row: selecting first is the same
            x = x[torch.arange(batch, device=device), logits_at.to(device)]
        elif scored_rows is not None:
            x = x[:scored_rows]
        if self.head is None:
            logits = self.lm_head(rms_norm(self.norm, x)).float()
        else:
            logits = self.head(x, norm=self.norm).float()
        if captured is None:
            return logits
        if any(captured[i] is None for i in capture):
            raise ValueError(f"cannot capture layers {capture}: the model has {len(self.layers)} layers")
        return Captured(logits, torch.cat([captured[i] for i in capture], dim=-1))

    def forward_trees(
        self,
        slots: list[int],
        prefix_lens: list[int],
        trees: list[TokenTree],
        last_only: bool = False,
        capture: tuple[int, ...] = (),
        unscored: int = 0,
    ) -> torch.Tensor | Captured:
        """Each tree written right after its prefix, seeing prefix + ancestors (verify, prefill).
        Trees of different sizes are padded to the widest, or, where the backend computes every
        row alone (``ragged_rows``), verified a node per row: no padding is computed, and the
        result has the padded shape, its padding rows zero. The last ``unscored`` trees (prefill
        chunks written beside a verification: ``ragged_rows`` only) get no logits: the logits
        are the other trees', padded to the widest of those."""
        tokens, depths, ancestors = pack_trees(trees)
        lens = torch.tensor(prefix_lens)
        if unscored or (not last_only and self.backend.ragged_rows and len({len(t) for t in trees}) > 1):
            if not self.backend.ragged_rows:
                raise ValueError(f"the {self.backend.name} backend pads rows: every tree is scored")
            return self._forward_ragged(slots, lens, trees, tokens, depths, ancestors, capture, unscored)
        logits_at = torch.tensor([len(t) - 1 for t in trees]) if last_only else None
        return self.forward(
            slots, prefix_lens, tokens, lens[:, None] + depths, lens, ancestors, logits_at, capture
        )

    def _forward_ragged(
        self,
        slots: list[int],
        lens: torch.Tensor,
        trees: list[TokenTree],
        tokens: torch.Tensor,
        depths: torch.Tensor,
        ancestors: torch.Tensor,
        capture: tuple[int, ...],
        unscored: int = 0,
    ) -> torch.Tensor | Captured:
        """``forward_trees`` over one row per node: node i of tree b is written at its prefix
        plus i and sees what it would see in b's padded row, and its logits (and features) land
        at ``[b, i]`` of the padded result; only the first ``len(trees) - unscored`` trees'
        rows (the first rows: a tree's nodes are consecutive) go through the head."""
        batch, width = tokens.shape
        sizes = torch.tensor([len(t) for t in trees])
        real = torch.arange(width)[None, :] < sizes[:, None]
        owner, node = real.nonzero(as_tuple=True)
        starts = lens[owner]
        scored = batch - unscored
        out = self.forward(
            [slots[b] for b in owner.tolist()],
            starts.tolist(),
            tokens[real][:, None],
            (starts + depths[real])[:, None],
            starts + node,
            ancestors[real][:, None],
            capture=capture,
            scored_rows=int(sizes[:scored].sum()) if unscored else None,
        )

        def padded(rows: torch.Tensor, trees: int) -> torch.Tensor:
            """The rows of the first ``trees`` trees, padded to the widest of them."""
            wide = int(sizes[:trees].max())
            places = (owner * wide + node)[: len(rows)]
            padding = (~real[:trees, :wide]).flatten().nonzero()[:, 0]
            spread = rows.new_empty(trees * wide, rows.shape[-1]).index_fill_(0, padding, 0)
            return spread.index_copy_(0, places, rows[:, 0]).view(trees, wide, -1)

        if isinstance(out, Captured):
            return Captured(padded(out.logits, scored), padded(out.features, batch))
        return padded(out, scored)
