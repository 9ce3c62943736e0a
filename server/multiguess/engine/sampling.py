"""Turning logits into the distribution a request samples from (temperature, top-k, top-p),
and drawing from it.

The same processing defines the target's distribution (the truth speculation must preserve)
and the draft's proposal distribution. It runs once per step over every sampled row of the
batch, each row with its own request's settings.

Truncation looks only at a ``torch.topk`` prefix of each row when that provably holds the
whole kept set (top-k within the prefix; top-p mass reached inside it), and sorts the whole
row otherwise: sorting a large vocabulary costs far more than a model step's sampling should.
Draws use the inverse CDF with one uniform each, for the same reason (``torch.multinomial``
on CPU walks the whole row several times).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from multiguess.engine.backends import sampling_kernels

# Prefix widths a row's truncation tries, in turn, before it sorts the whole row.
PREFIXES = (64, 2048)


@dataclass(frozen=True)
class Processing:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    def truncates(self, vocab: int) -> bool:
        """Whether top-k or top-p cut a row of ``vocab`` tokens at all."""
        return 0 < self.top_k < vocab or self.top_p < 1.0


def processed_probs(logits: torch.Tensor, rows: list[Processing]) -> torch.Tensor:
    """Float64 probabilities ``[N, V]`` after temperature, then top-k, then top-p, per row.

    Top-p keeps the smallest set of most probable tokens whose mass reaches ``top_p``; tokens
    tied at the boundary are kept in rank order. Equal to ``sorted_processed_probs``.
    """
    temperature, top_k, top_p, truncated = _settings(logits, rows)
    vocab = logits.shape[-1]
    widest_k = max((r.top_k for r in rows if 0 < r.top_k < vocab), default=0)
    if not any(truncated):
        return torch.softmax(logits.double() / temperature, dim=-1)
    if all(truncated):
        return _truncated(logits, temperature, top_k, top_p, widest_k, PREFIXES)
    out = logits.new_zeros(logits.shape, dtype=torch.float64)
    cut = torch.tensor([i for i, t in enumerate(truncated) if t], device=logits.device)
    keep = torch.tensor([i for i, t in enumerate(truncated) if not t], device=logits.device)
    out[keep] = torch.softmax(logits[keep].double() / temperature[keep], dim=-1)
    out[cut] = _truncated(logits[cut], temperature[cut], top_k[cut], top_p[cut], widest_k, PREFIXES)
    return out


def _truncated(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    widest_k: int,
    widths: tuple[int, ...],
) -> torch.Tensor:
    """Rows that truncate: by the first prefix width, the rows it does not settle by the next,
    and whatever is left by sorting whole rows."""
    vocab = logits.shape[-1]
    width = max(widths[0], widest_k) if widths else vocab
    if width >= vocab:
        return _sorted(logits.double() / temperature, top_k, top_p)
    probs, order, settled = _prefix(logits, temperature, top_k, top_p, width)
    out = logits.new_zeros(logits.shape, dtype=torch.float64).scatter_(-1, order, probs)
    if not bool(settled.all()):
        rest = (~settled).nonzero()[:, 0]
        out[rest] = _truncated(
            logits[rest], temperature[rest], top_k[rest], top_p[rest], widest_k, widths[1:]
        )
    return out


def kept_tokens(logits: torch.Tensor, processing: Processing) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens a truncating row of ``logits`` ``[V]`` keeps, in rank order, and their
    processed probabilities (float64, summing to 1): the row of ``processed_probs`` without its
    zeros, by the same prefixes and, where none holds the kept set, the same sort. On CPUs one
    kernel call (``bf16_kernel.kept_set``: the same rule, its own rounding) settles most rows
    first. None when the processing does not truncate."""
    vocab = logits.shape[-1]
    if not processing.truncates(vocab):
        return None
    widest_k = processing.top_k if 0 < processing.top_k < vocab else 0
    widths = [w for w in (max(w, widest_k) for w in PREFIXES) if w < vocab]
    kernels = sampling_kernels(logits.device)
    kept = (
        kernels.kept_set(logits, processing.temperature, widest_k, processing.top_p, PREFIXES[-1])
        if kernels and widths
        else None
    )
    if kept is not None:
        return kept
    temperature, top_k, top_p, _ = _settings(logits[None], [processing])
    for width in widths:
        probs, order, settled = _prefix(logits[None], temperature, top_k, top_p, width)
        if bool(settled[0]):
            break
    else:
        probs, order = _sorted_kept(logits[None].double() / temperature, top_k, top_p)
    kept = probs[0] > 0
    return order[0][kept], probs[0][kept]


class NodeDistributions:
    """One sampled sequence's processed target distribution after each tree node, each row
    processed when first read: acceptance walks one path of the tree, so most rows of a wide
    tree are never needed, and processing a row over the whole vocabulary costs a fair part of
    a CPU step. A row depends on its own logits and settings alone. A row only drawn from (a
    plain step, a leaf's bonus) or raced over never becomes a ``[V]`` tensor: a truncated row
    is its kept tokens, an untruncated one its logits (``draw``, ``seeded_choice``)."""

    def __init__(self, logits: torch.Tensor, processing: Processing) -> None:
        self.logits = logits
        self.processing = processing
        self._rows: dict[int, torch.Tensor] = {}
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def __getitem__(self, node: int) -> torch.Tensor:
        row = self._rows.get(node)
        if row is None:
            kept = self.kept(node)
            if kept is None:
                row = processed_probs(self.logits[node : node + 1], [self.processing])[0]
            else:
                ids, probs = kept
                row = probs.new_zeros(self.logits.shape[-1]).scatter_(0, ids, probs)
            self._rows[node] = row
        return row

    def kept(self, node: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``kept_tokens`` of ``node``'s row, computed once."""
        if node not in self._kept:
            self._kept[node] = kept_tokens(self.logits[node], self.processing)
        return self._kept[node]

    def stacked(self, nodes: list[int]) -> torch.Tensor:
        """The rows of ``nodes`` as one ``[len(nodes), V]`` tensor."""
        return torch.stack([self[node] for node in nodes])

    def draw(self, node: int, generator: torch.Generator) -> int:
        """A token drawn from ``node``'s row: by the inverse CDF over its kept tokens, or, for
        an untruncated row, by the race of ``raced_choice`` under a key drawn from
        ``generator`` (exact in distribution, like any Gumbel-max draw)."""
        kept = self.kept(node)
        if kept is not None:
            ids, probs = kept
            return int(ids[draw(probs, generator)])
        key = int(torch.randint(-(2**63), 2**63 - 1, (), generator=generator, device=self.logits.device))
        return raced_choice(self.logits[node], self.processing.temperature, key)

    def seeded_choice(self, node: int, seed: int, position: int) -> int:
        """The token a seeded sample takes after ``node`` at ``position``: the race over the
        processed row's kept tokens when its processing truncates, else straight from its logits."""
        kept = self.kept(node)
        if kept is None:
            return seeded_choice(self.logits[node], self.processing.temperature, seed, position)
        ids, probs = kept
        kernels = sampling_kernels(ids.device)
        rank = kernels.kept_race(ids, probs, position_key(seed, position)) if kernels else None
        return int(ids[race_top(probs[None], seed, [position], ids, 1)[0, 0] if rank is None else rank])


def _prefix(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Processing over each row's ``width`` best tokens: kept probabilities in rank order,
    their token ids, and which rows the prefix settles (it holds their whole kept set).

    Only the prefix is tempered in float64; the whole row is read by ``topk`` and, for rows
    without top-k, by the softmax normaliser."""
    values, order = torch.topk(logits, width, dim=-1)  # temperature does not change the order
    values = values.double() / temperature
    # Each rank's mass after top-k: normalised over the first top_k ranks when top-k applies
    # (the prefix then holds all of them), over the whole row otherwise.
    ranks = torch.arange(width, device=logits.device)[None, :]
    within_k = top_k <= width
    outside_k = ranks >= top_k[:, None]
    if bool(within_k.all()):
        normaliser = torch.logsumexp(values.masked_fill(outside_k, float("-inf")), dim=-1)
    else:
        normaliser = torch.where(
            within_k,
            torch.logsumexp(values.masked_fill(outside_k, float("-inf")), dim=-1),
            _log_normaliser(logits, temperature, values[:, :1]),
        )
    probs = torch.exp(values - normaliser[:, None]).masked_fill(outside_k, 0.0)
    # Every rank past the prefix has at least the prefix's mass before it: top-p cuts it.
    settled = within_k | (torch.cumsum(probs, dim=-1)[:, -1] >= top_p[:, 0])
    return _nucleus(probs, top_p), order, settled


def _log_normaliser(logits: torch.Tensor, temperature: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """log sum exp(logits / temperature) per row, in float64 through float32 exponents."""
    shifted = (logits.float() / temperature.float() - best.float()).exp_()
    return best[:, 0] + torch.log(shifted.sum(dim=-1, dtype=torch.float64))


def sorted_processed_probs(logits: torch.Tensor, rows: list[Processing]) -> torch.Tensor:
    """The reference processing: what ``processed_probs`` computes, by sorting every row whole."""
    temperature, top_k, top_p, truncated = _settings(logits, rows)
    scores = logits.double() / temperature
    out = torch.softmax(scores, dim=-1)
    rest = torch.tensor([i for i, t in enumerate(truncated) if t], dtype=torch.long, device=logits.device)
    if len(rest):
        out[rest] = _sorted(scores[rest], top_k[rest], top_p[rest])
    return out


def _settings(
    logits: torch.Tensor, rows: list[Processing]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[bool]]:
    """Each row's temperature ``[N, 1]``, top-k (the vocabulary size when off), top-p
    ``[N, 1]``, and whether it truncates at all."""
    vocab, device = logits.shape[-1], logits.device
    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float64, device=device)[:, None]
    top_k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float64, device=device)[:, None]
    truncated = [r.truncates(vocab) for r in rows]
    return temperature, top_k, top_p, truncated


def _sorted(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    probs, order = _sorted_kept(scores, top_k, top_p)
    return torch.zeros_like(probs).scatter(-1, order, probs)


def _sorted_kept(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole rows of tempered ``scores`` processed by sorting: probabilities in rank order (0
    past the kept set) and the token id of each rank."""
    vocab = scores.shape[-1]
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scores.device)[None, :]
    sorted_probs = torch.softmax(sorted_scores.masked_fill(ranks >= top_k[:, None], float("-inf")), dim=-1)
    return _nucleus(sorted_probs, top_p), order


def _nucleus(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities in descending order, cut where the mass before a rank reaches top_p."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    kept = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (``[V]``, any non-negative mass) by the inverse CDF."""
    cdf = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    return int(torch.searchsorted(cdf, (u * cdf[-1])[None], right=True).clamp_(max=len(cdf) - 1))


def draw_without_replacement(probs: torch.Tensor, count: int, generator: torch.Generator | None) -> list[int]:
    """``count`` distinct tokens, each drawn from ``probs`` without those drawn before it
    (what ``torch.multinomial(probs, count)`` samples); fewer when the support is smaller."""
    left = probs.double().clone()
    picks: list[int] = []
    for _ in range(count):
        if not bool((left > 0).any()):
            break
        token = draw(left, generator)
        picks.append(token)
        left[token] = 0.0
    return picks


def _signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 words (torch shifts arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key (as a signed integer) of one position's noise in a seeded sample."""
    return _signed(int.from_bytes(hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()))


def position_noise(seed: int, positions: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Exponential(1) noise ``[len(positions), len(tokens)]`` for the given token ids at each
    position of a seeded sample: a function of seed, position and token alone (splitmix64 of a
    per-position key), so every device and every tree shape sees the same values."""
    return key_noise([position_key(seed, position) for position in positions], tokens)


def key_noise(keys: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Exponential(1) noise ``[len(keys), len(tokens)]``: splitmix64 of each 64-bit key (as a
    signed integer) and token id, a function of the two alone."""
    return keyed_noise(torch.tensor(keys, dtype=torch.long, device=tokens.device), tokens)


def keyed_noise(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``key_noise`` of keys already in a tensor ``[R]`` on the tokens' device."""
    z = keys[:, None] + tokens.long()[None, :] * _GOLDEN
    z = (z ^ _shift(z, 30)) * _MIX1
    z = (z ^ _shift(z, 27)) * _MIX2
    z = z ^ _shift(z, 31)
    return -torch.log((_shift(z, 11).double() + 0.5) * 2.0**-53)


def seeded_choice(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """The winner of ``race_top``'s race over a whole row (no top-k, no top-p) under the noise
    of a seeded sample's ``position``, from its logits ``[V]`` (``raced_choice``)."""
    return raced_choice(logits, temperature, position_key(seed, position))


def raced_choice(logits: torch.Tensor, temperature: float, key: int) -> int:
    """The winner of the race over a whole row under the noise of ``key`` (``key_noise``): the
    largest p / noise is the largest ``logits / temperature - log(noise)`` (the Gumbel-max
    trick; the softmax's normaliser drops out). On CPUs a kernel scores only the tokens that
    can still win (``kernels/seeded_race.c``); elsewhere the whole row is scored."""
    kernels = sampling_kernels(logits.device)
    winner = kernels.seeded_argmax(logits, temperature, key) if kernels else None
    return scored_choice(logits, temperature, key) if winner is None else winner


def scored_choice(logits: torch.Tensor, temperature: float, key: int) -> int:
    """``raced_choice`` with every token of the row scored: what devices without the kernel
    run, and the reference the kernel must equal."""
    noise = key_noise([key], torch.arange(len(logits), device=logits.device))[0]
    return int((logits.double() / temperature - torch.log(noise)).argmax())


def race_top(
    probs: torch.Tensor, seed: int, positions: list[int], tokens: torch.Tensor, count: int
) -> torch.Tensor:
    """The ``count`` winners (column indices) of each row's exponential race (largest
    ``p / noise``, row i under the seeded noise of ``positions[i]``, column j being token
    ``tokens[j]``) within the support: the first is an exact draw from the row, the Gumbel-max
    trick without logarithms. Noise is made only for the columns some row can draw, since a
    truncated row's support is a sliver of the vocabulary and the noise costs per token. A row
    that can draw fewer than ``count`` tokens (while another can draw more) ends in columns it
    cannot draw, after its own winners: callers skip those (they have probability 0)."""
    drawable = probs > 0
    support = int(drawable.sum(dim=-1).max())
    distinct = sorted(set(positions))
    rows = torch.tensor([distinct.index(p) for p in positions], device=probs.device)
    columns = drawable.any(dim=0).nonzero()[:, 0]
    whole = len(columns) == len(tokens)  # nothing truncated: gathering would only copy
    racing, ids = (probs, tokens) if whole else (probs[:, columns], tokens[columns])
    noise = position_noise(seed, distinct, ids)[rows]
    winners = torch.topk(racing.double() / noise, min(count, support), dim=-1).indices
    return winners if whole else columns[winners]


# Settings columns of a ``settings_table``: temperature, top-k (the vocabulary when off), top-p,
# whether the row truncates at all.
SETTINGS_COLUMNS = 4


def settings_table(rows: list[Processing], vocab: int) -> torch.Tensor:
    """Each row's processing as a host float64 table ``[N, SETTINGS_COLUMNS]``, for the device
    in one copy (``RowSettings``)."""
    return torch.tensor(
        [
            (
                r.temperature,
                r.top_k if 0 < r.top_k < vocab else vocab,
                r.top_p,
                float(r.truncates(vocab)),
            )
            for r in rows
        ],
        dtype=torch.float64,
    ).reshape(len(rows), SETTINGS_COLUMNS)


@dataclass(frozen=True)
class RowSettings:
    """Per-row processing on the rows' device, from a ``settings_table``: what the batched
    functions below read instead of a list of ``Processing`` (no host data per call).
    ``truncating`` (known on the host) says whether any row truncates."""

    temperature: torch.Tensor  # [N, 1] float64
    top_k: torch.Tensor  # [N] long
    top_p: torch.Tensor  # [N, 1] float64
    truncated: torch.Tensor  # [N] bool
    truncating: bool

    @classmethod
    def of(cls, table: torch.Tensor, truncating: bool) -> RowSettings:
        return cls(table[:, 0:1], table[:, 1].long(), table[:, 2:3], table[:, 3] > 0, truncating)

    def __getitem__(self, index: torch.Tensor | slice) -> RowSettings:
        return RowSettings(
            self.temperature[index],
            self.top_k[index],
            self.top_p[index],
            self.truncated[index],
            self.truncating,
        )


def processed_rows(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """``processed_probs`` of rows ``[N, V]`` with device-side settings, without reading
    anything back: truncating rows are sorted whole (``sorted_processed_probs``), since
    choosing a prefix per row needs the host to look."""
    scores = logits.double() / settings.temperature
    plain = torch.softmax(scores, dim=-1)
    if not settings.truncating:
        return plain
    return torch.where(settings.truncated[:, None], _sorted(scores, settings.top_k, settings.top_p), plain)


def raced_rows(logits: torch.Tensor, settings: RowSettings, keys: torch.Tensor) -> torch.Tensor:
    """The winner ``[N]`` of each row's race under the noise of ``keys[i]`` (``keyed_noise``):
    ``scored_choice`` for a row that does not truncate, the race over its processed
    probabilities (``race_top``'s first winner) for one that does."""
    noise = keyed_noise(keys, torch.arange(logits.shape[-1], device=logits.device))
    scored = (logits.double() / settings.temperature - torch.log(noise)).argmax(dim=-1)
    if not settings.truncating:
        return scored
    probs = processed_rows(logits, settings)
    return torch.where(settings.truncated, (probs / noise).argmax(dim=-1), scored)


def drawn_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[N, V]`` by the inverse CDF at ``uniforms`` ``[N]``
    (``draw`` for every row at once)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    at = (uniforms.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, at, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


class Generators:
    """A sampled sequence's random streams, one per device it samples on, all from one seed.

    A generator samples only tensors on its own device, and a draft may live on another device
    than its target. Each device's stream is seeded from the seed and the device's name, so a
    seeded request repeats itself and two devices never share a stream."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        generator = self._by_device.get(device)
        if generator is None:
            digest = hashlib.blake2b(f"{self.seed}:{device}".encode(), digest_size=8).digest()
            generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest) >> 1)
            self._by_device[device] = generator
        return generator
