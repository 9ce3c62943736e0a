"""An EAGLE-3 head on a draft server: the target's features travel, the output stays the target's.

Real draft servers on 127.0.0.1 (uvicorn, WebSocket) host a random head built in the test on a
tiny random target. The truth is plain decoding of the target: greedy output through the remote
head equals it token for token (chains, trees, batches whose sequences leave at different steps),
and in bfloat16, where the features cross the wire without rounding, the server drafts exactly
the trees the local head drafts. Lost sessions and hostile frames cost speed, never output.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from multiguess import LLM
from multiguess.drafting import DraftOptions, Serving, host_drafter
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafter import DraftRequest, Proposal, TreeBudget
from multiguess.engine.drafters.base import Drafter, WrappedDrafter
from multiguess.engine.drafters.eagle3 import Eagle3Drafter
from multiguess.engine.engine import Engine
from multiguess.engine.guard import GuardedDrafter
from multiguess.errors import IncompatibleDraftError
from multiguess.models.draft_head import load_draft_head, read_embedding
from multiguess.models.eagle3_checkpoint import head_drafter
from multiguess.models.loading import load_model
from multiguess.params import SamplingParams
from multiguess.remote.client import FeatureBuffer, RemoteDrafter, closed_for_protocol, rows_within
from multiguess.remote.protocol import (
    Drafted,
    Failed,
    Features,
    Request,
    ServerInfo,
    StepMessage,
    StepReply,
    decode_reply,
    encode_step,
    tokenizer_fingerprint,
)
from multiguess.remote.server import DraftServerSettings
from safetensors.torch import load_file, save_file
from websockets.exceptions import ConnectionClosed

from tests.api.hostile_draft import HostileDraftServer
from tests.engine import test_sampling_exact as exact
from tests.engine.test_eagle3 import plain_outputs, saved_head, small_vocab_target  # noqa: F401
from tests.remote.conftest import (
    DraftServer,
    client_metric,
    open_connection,
    remote_engine,
    servers_on_demand,
)
from tests.servers import wait_ready

PROMPTS = [[5, 6, 7, 4, 5, 6], [7], [4, 4, 5, 7, 6, 5, 4, 7, 7, 6, 5]]
MAX_TOKENS = [10, 24, 16]  # the first sequence leaves early: the last one moves into its slot
SETTINGS = dict(max_sessions=8, max_model_len=128, max_tree_nodes=16)


@pytest.fixture(scope="module")
def head(small_vocab_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return saved_head(small_vocab_target, tmp_path_factory.mktemp("remote-eagle3") / "head", seed=12)


@pytest.fixture
def head_server(small_vocab_target: Path, head: Path) -> Iterator[Callable[..., DraftServer]]:  # noqa: F811
    """Starts draft servers hosting the head; stops those still running at the end."""

    def make(dtype: str = "float32", **settings: object) -> DraftServer:
        options = DraftOptions(str(head), dtype, "cpu", target=str(small_vocab_target))
        return DraftServer(
            head, DraftServerSettings(**(SETTINGS | settings)), lambda: host_drafter("eagle3", options)
        )

    yield from servers_on_demand(make)


def config(num_candidates: int, depth: int) -> EngineConfig:
    """Fixed trees and no prompt lookup, which only local drafters' trees take: the local and
    the remote head then verify the same trees."""
    return EngineConfig(
        num_candidates, depth, 16, max_batch=4, max_model_len=128, adaptive=False, prompt_lookup=0
    )


class Recorder(WrappedDrafter):
    """A drafter that keeps every tree its inner drafter proposed (the rest passes through)."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.trees: list[list[tuple[int, ...]]] = []

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = self.inner.propose(requests)
        self.trees.append([p.tree.tokens + p.tree.parents for p in proposals])
        return proposals


def run(
    engine: Engine, prompts: list[list[int]] = PROMPTS, lengths: list[int] = MAX_TOKENS
) -> list[list[int]]:
    seqs = [
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


def expected(target: Path, dtype: str) -> list[list[int]]:
    longest = plain_outputs(target, PROMPTS, dtype, max(MAX_TOKENS))
    return [out[:n] for out, n in zip(longest, MAX_TOKENS, strict=True)]


@pytest.mark.parametrize(("num_candidates", "depth"), [(1, 4), (3, 3)], ids=["chain", "tree"])
def test_remote_head_greedy_output_is_the_targets_own(
    head_server: Callable[..., DraftServer],
    small_vocab_target: Path,  # noqa: F811
    num_candidates: int,
    depth: int,
) -> None:
    server = head_server()
    target = load_model(str(small_vocab_target), dtype="float32")
    engine, drafter = remote_engine(target, server.url, config(num_candidates, depth))
    assert run(engine) == expected(small_vocab_target, "float32")
    assert engine.totals.accepted_tokens > 0 and engine.totals.fallback_steps == 0
    assert drafter.feature_layers == tuple(drafter.info.feature_layers) != ()  # type: ignore[union-attr]
    assert client_metric(drafter, "multiguess_remote_draft_resends_total") == 0
    assert client_metric(drafter, "multiguess_remote_draft_connects_total") == 1
    prompt_features = sum(len(p) - 1 for p in PROMPTS) * drafter.info.feature_width * 2  # type: ignore[union-attr]
    assert client_metric(drafter, "multiguess_remote_draft_sent_bytes_total") > prompt_features


def test_remote_head_drafts_the_local_heads_trees(
    head_server: Callable[..., DraftServer],
    small_vocab_target: Path,  # noqa: F811
    head: Path,
) -> None:
    """In bfloat16 the features cross the wire unrounded: step for step the server proposes
    the trees the head drafting in the target's process proposes, moves and all."""
    server = head_server(dtype="bfloat16")
    target = load_model(str(small_vocab_target), dtype="bfloat16")
    local_trees = Recorder(head_drafter(head, target))
    local = Engine(target, local_trees, config(3, 3))
    remote, drafter = remote_engine(target, server.url, config(3, 3), wrap=Recorder)
    outputs = run(local)
    assert run(remote) == outputs == expected(small_vocab_target, "bfloat16")
    assert isinstance(remote.drafter, Recorder)
    assert remote.drafter.trees == local_trees.trees
    assert remote.totals.accepted_tokens == local.totals.accepted_tokens > 0
    assert remote.totals.fallback_steps == 0
    assert client_metric(drafter, "multiguess_remote_draft_resends_total") == 0


def test_a_restarted_server_resumes_drafting(
    head_server: Callable[..., DraftServer],
    small_vocab_target: Path,  # noqa: F811
) -> None:
    """The server restarts mid-stream: its sessions and features are gone; the steps in
    between decode with the target alone, then the head drafts again from the features sent
    after the restart."""
    server = head_server()
    target = load_model(str(small_vocab_target), dtype="float32")
    engine, _ = remote_engine(target, server.url, config(3, 3))
    seqs = [
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    for _ in range(3):
        engine.step()
    server.stop()
    server.start()
    drafted_before = engine.totals.draft_tokens
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.02)  # lets the cool-down after the failure end within the run
    assert [s.output_ids for s in seqs] == plain_outputs(small_vocab_target, PROMPTS, "float32", 30)
    assert engine.totals.fallback_steps > 0
    assert engine.totals.draft_tokens > drafted_before
    assert server.metric("multiguess_draft_requests_total") > 0


def test_an_evicted_session_is_resent_and_drafts_from_the_latest_features(
    head_server: Callable[..., DraftServer],
    small_vocab_target: Path,  # noqa: F811
) -> None:
    server = head_server(idle_seconds=1.0)
    target = load_model(str(small_vocab_target), dtype="float32")
    engine, drafter = remote_engine(target, server.url, config(3, 3))
    seqs = [
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    for step in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
        if step == 2:
            time.sleep(1.5)  # every session idles past the timeout: the next step finds none
    assert [s.output_ids for s in seqs] == plain_outputs(small_vocab_target, PROMPTS, "float32", 24)
    resends = client_metric(drafter, "multiguess_remote_draft_resends_total")
    assert resends >= len(PROMPTS)  # more where a step of this busy machine took a second
    assert server.metric("multiguess_draft_session_evictions_total", reason="idle") == resends
    assert engine.totals.fallback_steps == 0 and engine.totals.accepted_tokens > 0


@pytest.mark.parametrize("seed", [None, 17], ids=["rejection", "seeded"])
def test_remote_head_sampling_matches_the_target_exactly(
    head_server: Callable[..., DraftServer],
    small_vocab_target: Path,  # noqa: F811
    seed: int | None,
) -> None:
    """The chi-square test of ``test_sampling_exact`` with the head on a draft server: sampled
    children are verified with the float32 rows that travel (unseeded) or their fixed noise."""
    server = head_server(max_sessions=256, max_model_len=16)
    llm = LLM(str(small_vocab_target), None, 3, 2, dtype="float32", max_batch=256, drafter="none",
              adaptive=False, serving=Serving(step_timeout=30, url=server.url))  # fmt: skip
    assert isinstance(llm.engine.drafter, GuardedDrafter) and llm.engine.drafter.feature_layers
    params = SamplingParams(
        max_tokens=exact.LENGTH, ignore_eos=True, n=exact.SAMPLES, seed=seed, temperature=1.0
    )
    samples = exact.draw(llm, params)
    stats = llm.engine.totals
    assert stats.accepted_tokens > 0 and stats.fallback_steps == 0
    pvalue = exact.chi_square_pvalue(samples, exact.exact_distribution(small_vocab_target, params))
    assert len(samples) == exact.SAMPLES and pvalue > exact.ALPHA, f"p = {pvalue:.2e}"


def request(tokens: list[int], features: Features | None) -> StepMessage:
    return StepMessage(requests=(Request(0, 0, tuple(tokens), TreeBudget(3, 3, 8), None, features),))


def exchange(conn: object, message: StepMessage | bytes, vocab: int) -> StepReply:
    conn.send(message if isinstance(message, bytes) else encode_step(message))  # type: ignore[attr-defined]
    return decode_reply(conn.recv(timeout=10), vocab)  # type: ignore[attr-defined]


def test_hostile_feature_frames_are_refused_and_the_server_serves_on(
    head_server: Callable[..., DraftServer],
) -> None:
    server = head_server(max_frame_bytes=64 * 1024)
    conn, info = open_connection(server.url)
    width, vocab = info.feature_width, info.vocab_size
    tokens = [5, 6, 7, 4, 5]
    good = Features.of(0, torch.randn(len(tokens) - 1, width))
    nan = torch.randn(len(tokens) - 1, width)
    nan[2, 3] = math.nan
    cases = {
        "width": Features.of(0, torch.randn(len(tokens) - 1, width + 2)),
        "NaN or infinity": Features.of(0, nan),
        "needs them to end at position 3": Features.of(0, torch.randn(2, width)),
    }
    for error, features in cases.items():
        (result,) = exchange(conn, request(tokens, features), vocab).results
        assert isinstance(result, Failed) and error in result.reason, (error, result)
    (result,) = exchange(conn, request(tokens, good), vocab).results
    assert isinstance(result, Drafted) and len(result.tree) > 1  # the same connection drafts on
    # Frames that do not parse, or are larger than the server accepts, close that connection.
    truncated = encode_step(request(tokens, good))[:-7]
    huge = request(tokens * 100, Features.of(0, torch.randn(len(tokens) * 100 - 1, width)))
    for frame, code, error in ((truncated, 1002, "truncated"), (encode_step(huge), 1009, "exceeds limit")):
        conn, _ = open_connection(server.url)
        conn.send(frame)
        with pytest.raises(ConnectionClosed) as closed:
            conn.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == code
        assert error in closed.value.rcvd.reason
        assert closed_for_protocol(closed.value)  # the target counts it as a protocol failure
    conn, _ = open_connection(server.url)  # another connection drafts as if nothing happened
    (result,) = exchange(conn, request(tokens, good), vocab).results
    assert isinstance(result, Drafted) and len(result.tree) > 1


def test_a_draft_model_server_refuses_features(draft_server: Callable[..., DraftServer]) -> None:
    server = draft_server()
    conn, info = open_connection(server.url)
    assert info.feature_layers == () and info.feature_width == 0
    (result,) = exchange(conn, request([5, 6, 7], Features.of(0, torch.ones(2, 8))), info.vocab_size).results
    assert isinstance(result, Failed) and "reads no target features" in result.reason


@pytest.mark.parametrize(
    ("layers", "width", "error"),
    [((1, 2, 9), 3 * 64, "the target has 4"), ((1, 2, 3), 3 * 64 + 1, "wide")],
    ids=["layers", "width"],
)
def test_a_server_announcing_features_the_target_cannot_give_is_refused(
    small_vocab_target: Path,  # noqa: F811
    layers: tuple[int, ...],
    width: int,
    error: str,
) -> None:
    """A hostile hello must not make the target capture layers it lacks: the client refuses
    it, the step decodes with the target alone, and the output is the target's."""
    target = load_model(str(small_vocab_target), dtype="float32")
    info = ServerInfo("hostile", tokenizer_fingerprint(target.tokenizer), target.model.config.vocab_size,
                      128, 8, feature_layers=layers, feature_width=width)  # fmt: skip
    hostile = HostileDraftServer(info, "wrong_root")
    try:
        wait_ready(hostile.url)
        drafter = RemoteDrafter(hostile.url, target.tokenizer, target_config=target.model.config)
        with pytest.raises(IncompatibleDraftError, match=error):
            drafter.propose([DraftRequest(0, [5, 6, 7], TreeBudget())])
        assert drafter.feature_layers == ()
        engine = Engine(
            target, GuardedDrafter(drafter, target.model.config.vocab_size, cooldown=0), config(3, 3)
        )
        outputs = run(engine, PROMPTS, [8, 8, 8])
    finally:
        hostile.stop()
    assert outputs == plain_outputs(small_vocab_target, PROMPTS, "float32", 8)
    assert engine.totals.fallback_steps > 0 and engine.totals.draft_tokens == 0


def test_features_wait_for_the_server_and_fit_its_frames() -> None:
    buffer = FeatureBuffer(4)
    buffer.add(4, torch.ones(3, 2), limit=100)
    buffer.add(7, torch.full((2, 2), 2.0), limit=100)
    sent = buffer.wire(5)
    assert sent is not None and (sent.position, sent.rows) == (4, 5)
    assert torch.equal(sent.tensor()[-1], torch.full((2,), 2.0, dtype=torch.bfloat16))
    tail = buffer.wire(2)
    assert tail is not None and (tail.position, tail.rows) == (7, 2)
    buffer.add(20, torch.ones(1, 2), limit=100)  # a gap: the engine forgot the sequence
    assert (buffer.position, buffer.rows) == (20, 1)
    buffer.add(21, torch.ones(5, 2), limit=4)
    assert (buffer.position, buffer.rows, buffer.end) == (22, 4, 26)
    assert rows_within([3, 40, 7], 100) == [3, 40, 7]
    assert rows_within([3, 40, 7], 20) == [3, 10, 7]
    assert rows_within([30, 40], 10) == [5, 5]
    assert sum(rows_within([1, 2, 50, 9], 13)) <= 13


def test_prefix_reuse_computes_a_remote_heads_features() -> None:
    """A sequence that starts with another's tokens: the draft server holds none of their
    features, so the target may skip them only when the server reads none."""
    drafter = RemoteDrafter("http://127.0.0.1:9", None)
    assert drafter.share(0, 1, 12) == 12
    drafter.info = ServerInfo("head", "abc", 64, 128, 8, feature_layers=(1, 2, 3), feature_width=192)
    assert drafter.share(0, 1, 12) == 0


def test_serve_accepts_a_remote_head(
    small_vocab_target: Path,  # noqa: F811
    head_server: Callable[..., DraftServer],
) -> None:
    """``serve --drafter eagle3 --draft-url``: the remote drafter checks the head's layers
    against the target's config."""
    from multiguess.cli import build_parser
    from multiguess.commands.serve import build_engine

    server = head_server()
    argv = ["serve", "--target", str(small_vocab_target), "--drafter", "eagle3", "--draft-url", server.url,
            "--dtype", "float32", "--device", "cpu", "--max-model-len", "128", "--no-adaptive"]  # fmt: skip
    engine = build_engine(build_parser().parse_args(argv))
    assert isinstance(engine.drafter, GuardedDrafter) and isinstance(engine.drafter.inner, RemoteDrafter)
    assert run(engine, PROMPTS[:2], [12, 12]) == plain_outputs(small_vocab_target, PROMPTS[:2], "float32", 12)
    assert engine.drafter.feature_layers != () and engine.totals.accepted_tokens > 0


def test_the_draft_server_reads_only_the_targets_embeddings(
    small_vocab_target: Path,  # noqa: F811
    head: Path,
    tmp_path: Path,
) -> None:
    """``serve-draft --drafter eagle3``: the head gets the target's embedding matrix, read alone
    from its weights; a head with its own embeddings needs no target weights at all."""
    from multiguess.cli import build_parser
    from multiguess.commands.serve_draft import load_draft

    target = load_model(str(small_vocab_target), dtype="float32")
    argv = ["serve-draft", "--drafter", "eagle3", "--draft", str(head), "--target", str(small_vocab_target),
            "--dtype", "float32", "--device", "cpu"]  # fmt: skip
    hosted = load_draft(build_parser().parse_args(argv))
    assert isinstance(hosted.drafter, Eagle3Drafter)
    assert torch.equal(hosted.drafter.embed.weight, target.model.model.embed_tokens.weight)
    assert torch.equal(read_embedding(str(small_vocab_target)), target.model.model.embed_tokens.weight)
    own = tmp_path / "own-head"
    own.mkdir()
    state = load_file(head / "model.safetensors")
    state["embed_tokens.weight"] = torch.randn(target.model.config.vocab_size, 64)
    save_file(state, str(own / "model.safetensors"))
    (own / "config.json").write_text((head / "config.json").read_text())
    bare = tmp_path / "target-without-weights"
    bare.mkdir()
    for item in small_vocab_target.iterdir():
        if not item.name.endswith(".safetensors"):
            (bare / item.name).write_bytes(item.read_bytes())
    loaded = load_draft_head(str(own), str(bare), "float32", "cpu")
    assert torch.equal(loaded.embed.weight, state["embed_tokens.weight"])
    assert tokenizer_fingerprint(loaded.tokenizer) == tokenizer_fingerprint(target.tokenizer)
    assert json.loads((bare / "config.json").read_text())["vocab_size"] == target.model.config.vocab_size
    with pytest.raises(SystemExit, match="needs --draft"):
        load_draft(build_parser().parse_args(["serve-draft", "--drafter", "eagle3", "--target", str(bare)]))
