"""The draft protocol's wire format: compact binary frames over one WebSocket per target server.

Each engine step is one round trip. The target sends one ``StepMessage``: the slots it
released, the sequences it moved to other slots, the paths accepted since the last step (so
the server keeps only their draft KV), and one request per sequence with only the tokens the
server has not been sent yet and, for a feature-reading head (EAGLE-3), the target's features
of the positions it has not been sent yet, as bfloat16. The server answers one ``StepReply`` with a result per request: a proposal, a ``Resend`` (its
session was evicted or the server restarted: send the sequence again from ``held``), or a
``Failed`` reason. Draft distributions travel as float32 (dense, or sparse after top-k/top-p):
the server rounds them to float32 *before* sampling, so what arrives is bit for bit what the
children were drawn from, and sampling stays exact.

Integers are little-endian; a frame that does not parse raises ``ProtocolError``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from multiguess.engine.drafter import TreeBudget
from multiguess.engine.tree import TokenTree
from multiguess.options import DRAFT_MAX_FRAME_BYTES

VERSION = 2
PATH = "/v1/draft"
STEP, REPLY = 1, 2
OK, RESEND, FAILED = 0, 1, 2
DENSE, SPARSE = 0, 1
SAMPLED, WITH_FEATURES = 1, 2  # a request's flags
PROTOCOL_ERROR = 1002  # WebSocket close codes: a message that breaks the protocol,
MESSAGE_TOO_BIG = 1009  # a message larger than the server accepts (``max_frame_bytes``)
# How tokens and parents travel: uint32 ids, int32 parents (the root's is -1).
_HEAD = struct.Struct("<BBHHHH")  # kind, version, releases, moves, commits, requests
_MOVE = struct.Struct("<II")  # from slot, to slot
_COMMIT = struct.Struct("<IH")  # slot, path length
_REQUEST = struct.Struct("<IIIBBHB")  # slot, start, tokens, num_candidates, depth, max_nodes, flags
_SAMPLING = struct.Struct("<ddIQ")  # temperature, top_p, top_k, seed
_FEATURES = struct.Struct("<III")  # first position, rows, width (then rows x width bfloat16)
_REPLY_HEAD = struct.Struct("<BBHf")  # kind, version, results, server seconds
_RESULT = struct.Struct("<BI")  # status, nodes | held | message bytes
_PROBS = struct.Struct("<IBI")  # node, encoding, entries
_MAX_TOKEN = 2**32 - 1


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


@dataclass(frozen=True)
class Sampling:
    """A sampled request's processing; ``seed`` seeds the server's draws for this step."""

    temperature: float
    top_p: float
    top_k: int
    seed: int


@dataclass(frozen=True)
class Features:
    """The target's features of positions ``position..position + rows - 1``: ``width`` values a
    position (the head's layers side by side), as little-endian bfloat16 bytes."""

    position: int
    width: int
    values: bytes

    @property
    def rows(self) -> int:
        return len(self.values) // (2 * self.width) if self.width else 0

    @classmethod
    def of(cls, position: int, features: torch.Tensor) -> Features:
        """``features`` ``[rows, width]`` of any dtype and device, rounded to bfloat16."""
        rows = features.detach().to("cpu", torch.bfloat16).contiguous()
        values = rows.view(torch.int16).numpy().astype("<i2").tobytes()
        return cls(position, int(rows.shape[-1]), values)

    def tensor(self) -> torch.Tensor:
        """``[rows, width]`` bfloat16 on the host."""
        raw = np.frombuffer(self.values, dtype="<i2").astype(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(self.rows, self.width)


@dataclass(frozen=True)
class Request:
    """Draft a tree for the sequence ``held[:start] + tokens`` (``held``: what the server has)."""

    slot: int
    start: int
    tokens: tuple[int, ...]
    budget: TreeBudget
    sampling: Sampling | None = None
    features: Features | None = None


@dataclass(frozen=True)
class Commit:
    """The accepted path (node indices, root first) of the slot's last proposed tree."""

    slot: int
    path: tuple[int, ...]


@dataclass(frozen=True)
class StepMessage:
    """Applied in this order: ``releases`` (slots as the last message named them), ``moves``
    (``(from, to)`` pairs, all at once), then ``commits`` and ``requests`` (slots as named now)."""

    releases: tuple[int, ...] = ()
    commits: tuple[Commit, ...] = ()
    requests: tuple[Request, ...] = ()
    moves: tuple[tuple[int, int], ...] = ()


@dataclass
class Drafted:
    tree: TokenTree
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # float32 rows


@dataclass(frozen=True)
class Resend:
    """The server holds only ``held`` tokens of this session: send the sequence from there."""

    held: int


@dataclass(frozen=True)
class Failed:
    reason: str


Result = Drafted | Resend | Failed


@dataclass
class StepReply:
    results: list[Result]
    server_seconds: float = 0.0


class _Reader:
    """Consumes a frame front to back; running past its end is a ``ProtocolError``."""

    def __init__(self, data: bytes) -> None:
        self.view = memoryview(data)
        self.pos = 0

    def take(self, size: int) -> memoryview:
        if size < 0 or self.pos + size > len(self.view):
            raise ProtocolError(f"frame truncated at byte {self.pos} (needs {size} more)")
        chunk = self.view[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def unpack(self, layout: struct.Struct) -> tuple:
        return layout.unpack(self.take(layout.size))

    def array(self, dtype: str, count: int) -> np.ndarray:
        item = np.dtype(dtype)
        return np.frombuffer(self.take(count * item.itemsize), dtype=item)

    def done(self) -> None:
        if self.pos != len(self.view):
            raise ProtocolError(f"{len(self.view) - self.pos} unexpected trailing bytes")


def _check_kind(kind: int, version: int, expected: int) -> None:
    if kind != expected:
        raise ProtocolError(f"expected message kind {expected}, got {kind}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")


def encode_step(message: StepMessage) -> bytes:
    try:
        return _encode_step(message)
    except (struct.error, OverflowError) as exc:  # a value too large for its field
        raise ProtocolError(f"message does not fit the wire format: {exc}") from None


def _encode_step(message: StepMessage) -> bytes:
    counts = (len(message.releases), len(message.moves), len(message.commits), len(message.requests))
    parts = [_HEAD.pack(STEP, VERSION, *counts)]
    parts.append(np.asarray(message.releases, dtype="<u4").tobytes())
    parts += [_MOVE.pack(src, dst) for src, dst in message.moves]
    for commit in message.commits:
        parts.append(_COMMIT.pack(commit.slot, len(commit.path)))
        parts.append(np.asarray(commit.path, dtype="<u2").tobytes())
    for req in message.requests:
        b = req.budget
        parts.append(
            _REQUEST.pack(
                req.slot,
                req.start,
                len(req.tokens),
                b.num_candidates,
                b.depth,
                b.max_nodes,
                (SAMPLED if req.sampling is not None else 0)
                | (WITH_FEATURES if req.features is not None else 0),
            )
        )
        if req.sampling is not None:
            s = req.sampling
            parts.append(_SAMPLING.pack(s.temperature, s.top_p, s.top_k, s.seed))
        parts.append(np.asarray(req.tokens, dtype="<u4").tobytes())
        if req.features is not None:
            f = req.features
            parts += [_FEATURES.pack(f.position, f.rows, f.width), f.values]
    return b"".join(parts)


def decode_step(data: bytes) -> StepMessage:
    reader = _Reader(data)
    kind, version, n_releases, n_moves, n_commits, n_requests = reader.unpack(_HEAD)
    _check_kind(kind, version, STEP)
    releases = tuple(reader.array("<u4", n_releases).tolist())
    moves = tuple(reader.unpack(_MOVE) for _ in range(n_moves))
    if len({src for src, _ in moves}) < n_moves or len({dst for _, dst in moves}) < n_moves:
        raise ProtocolError(f"moves {moves} name a slot twice")
    commits = []
    for _ in range(n_commits):
        slot, length = reader.unpack(_COMMIT)
        commits.append(Commit(slot, tuple(reader.array("<u2", length).tolist())))
    requests = []
    for _ in range(n_requests):
        slot, start, n_tokens, num_candidates, depth, max_nodes, flags = reader.unpack(_REQUEST)
        if flags & ~(SAMPLED | WITH_FEATURES):
            raise ProtocolError(f"unknown request flags {flags:#04x}")
        sampling = Sampling(*reader.unpack(_SAMPLING)) if flags & SAMPLED else None
        if sampling is not None and not (sampling.temperature > 0 and 0 < sampling.top_p <= 1):
            raise ProtocolError(f"bad sampling settings {sampling}: need temperature > 0, 0 < top_p <= 1")
        tokens = tuple(reader.array("<u4", n_tokens).tolist())
        try:
            budget = TreeBudget(num_candidates, depth, max_nodes)
        except ValueError as exc:
            raise ProtocolError(f"bad tree budget: {exc}") from None
        features = _decode_features(reader) if flags & WITH_FEATURES else None
        requests.append(Request(slot, start, tokens, budget, sampling, features))
    reader.done()
    return StepMessage(releases, tuple(commits), tuple(requests), moves)


def _decode_features(reader: _Reader) -> Features:
    position, rows, width = reader.unpack(_FEATURES)
    if rows < 1 or width < 1:
        raise ProtocolError(f"a feature block of {rows} rows of width {width}: both must be >= 1")
    if rows * width * 2 > len(reader.view) - reader.pos:
        raise ProtocolError(f"frame truncated: {rows} feature rows of width {width} do not fit in it")
    return Features(position, width, bytes(reader.take(rows * width * 2)))


def encode_reply(reply: StepReply) -> bytes:
    parts = [_REPLY_HEAD.pack(REPLY, VERSION, len(reply.results), reply.server_seconds)]
    for result in reply.results:
        if isinstance(result, Resend):
            parts.append(_RESULT.pack(RESEND, result.held))
        elif isinstance(result, Failed):
            text = result.reason.encode()
            parts += [_RESULT.pack(FAILED, len(text)), text]
        else:
            tree = result.tree
            parts.append(_RESULT.pack(OK, len(tree)))
            parts.append(np.asarray(tree.tokens, dtype="<u4").tobytes())
            parts.append(np.asarray(tree.parents, dtype="<i4").tobytes())
            parts.append(struct.pack("<H", len(result.draft_probs)))
            parts += [_encode_row(node, row) for node, row in sorted(result.draft_probs.items())]
    return b"".join(parts)


def _encode_row(node: int, row: torch.Tensor) -> bytes:
    """A distribution row as float32: sparse (ids, values) when that is smaller than dense."""
    values = row.detach().to(torch.float32).cpu().numpy()
    nonzero = np.flatnonzero(values)
    if 2 * len(nonzero) < len(values):
        return b"".join(
            (
                _PROBS.pack(node, SPARSE, len(nonzero)),
                nonzero.astype("<u4").tobytes(),
                values[nonzero].astype("<f4").tobytes(),
            )
        )
    return _PROBS.pack(node, DENSE, len(values)) + values.astype("<f4").tobytes()


def decode_reply(data: bytes, vocab_size: int) -> StepReply:
    """Parse a reply; ``vocab_size`` sizes the sparse rows (the server announced it at hello)."""
    reader = _Reader(data)
    kind, version, count, seconds = reader.unpack(_REPLY_HEAD)
    _check_kind(kind, version, REPLY)
    results: list[Result] = []
    for _ in range(count):
        status, value = reader.unpack(_RESULT)
        if status == RESEND:
            results.append(Resend(value))
        elif status == FAILED:
            results.append(Failed(bytes(reader.take(value)).decode(errors="replace")))
        elif status == OK:
            results.append(_decode_drafted(reader, value, vocab_size))
        else:
            raise ProtocolError(f"unknown result status {status}")
    reader.done()
    return StepReply(results, seconds)


def _decode_drafted(reader: _Reader, nodes: int, vocab_size: int) -> Drafted:
    tokens = reader.array("<u4", nodes).tolist()
    parents = reader.array("<i4", nodes).tolist()
    try:
        tree = TokenTree(tuple(tokens), tuple(parents))
    except ValueError as exc:
        raise ProtocolError(f"bad tree: {exc}") from None
    (rows,) = struct.unpack("<H", reader.take(2))
    probs = {}
    for _ in range(rows):
        node, encoding, entries = reader.unpack(_PROBS)
        if node >= nodes:
            raise ProtocolError(f"distribution for node {node} of a {nodes}-node tree")
        if encoding == DENSE:
            if entries != vocab_size:
                raise ProtocolError(f"dense row of {entries} entries, vocabulary is {vocab_size}")
            row = torch.from_numpy(reader.array("<f4", entries).copy())
        elif encoding == SPARSE:
            ids = torch.from_numpy(reader.array("<u4", entries).astype(np.int64))
            values = torch.from_numpy(reader.array("<f4", entries).copy())
            if entries and int(ids.max()) >= vocab_size:
                raise ProtocolError(f"sparse row names token {int(ids.max())} >= vocabulary {vocab_size}")
            row = torch.zeros(vocab_size, dtype=torch.float32).index_put_((ids,), values)
        else:
            raise ProtocolError(f"unknown row encoding {encoding}")
        probs[node] = row
    return Drafted(tree, probs)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Digest of the vocabulary and special tokens: equal digests mean token ids mean the same."""
    specials = {
        a: getattr(tokenizer, a) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    text = json.dumps([sorted(tokenizer.get_vocab().items()), specials], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_display_name(name: str) -> str:
    """The last component of a model's folder or hub id: what a peer may be told about it."""
    return Path(name.rstrip("/")).name or "draft"


def websocket_url(url: str) -> str:
    """``http://host:port`` (what the operator sets) -> ``ws://host:port/v1/draft``."""
    parts = urlsplit(url)
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"draft URL must look like http://host:port, got {url!r}")
    path = parts.path.rstrip("/") or PATH
    return urlunsplit((schemes[parts.scheme], parts.netloc, path, parts.query, ""))


@dataclass(frozen=True)
class ServerInfo:
    """What the server announces after the handshake (a JSON text frame), before any step.

    ``model`` is a display name, never a filesystem path (``model_display_name``)."""

    model: str
    fingerprint: str
    vocab_size: int
    max_model_len: int
    max_sessions: int
    version: int = VERSION
    # A head that reads the target's hidden states (EAGLE-3): the target layers it reads
    # (transformers' ``output_hidden_states`` index) and the width of a position's features.
    feature_layers: tuple[int, ...] = ()
    feature_width: int = 0
    max_frame_bytes: int = DRAFT_MAX_FRAME_BYTES

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> ServerInfo:
        try:
            raw = json.loads(text)
            raw["feature_layers"] = tuple(raw.get("feature_layers", ()))
            info = cls(**raw)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"bad server hello: {exc}") from None
        if info.version != VERSION:
            raise ProtocolError(f"draft server speaks protocol {info.version}, this client {VERSION}")
        problem = info.problem()
        if problem:
            raise ProtocolError(f"bad server hello: {problem}")
        return info

    def problem(self) -> str | None:
        """What makes these values unusable (they came from the network), or None."""
        numbers = (
            self.vocab_size,
            self.max_model_len,
            self.max_sessions,
            self.feature_width,
            self.max_frame_bytes,
        )
        if not all(type(n) is int for n in (*numbers, *self.feature_layers)):
            return "sizes and feature layers must be integers"
        if min(self.vocab_size, self.max_model_len, self.max_sessions, self.max_frame_bytes) < 1:
            return "vocab_size, max_model_len, max_sessions and max_frame_bytes must be >= 1"
        if min(self.feature_layers, default=0) < 0 or self.feature_width < 0:
            return "feature layers and width must be >= 0"
        if bool(self.feature_layers) != bool(self.feature_width):
            return "feature layers and a feature width come together"
        return None
