"""The wire format: every message survives a round trip; malformed frames get a clear error."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from multiguess.engine.drafter import TreeBudget
from multiguess.engine.tree import TokenTree
from multiguess.remote import handshake
from multiguess.remote.handshake import ClientHello
from multiguess.remote.protocol import (
    Commit,
    Drafted,
    Failed,
    Features,
    ProtocolError,
    Request,
    Resend,
    Sampling,
    ServerInfo,
    StepMessage,
    StepReply,
    decode_reply,
    decode_step,
    encode_reply,
    encode_step,
    model_display_name,
    tokenizer_fingerprint,
    websocket_url,
)

from tests.tiny_models import WORDS, build_tokenizer

VOCAB = 64


def test_step_message_round_trips() -> None:
    message = StepMessage(
        releases=(3, 7),
        commits=(Commit(1, (0, 2, 5)), Commit(4, (0,))),
        requests=(
            Request(1, 12, (5, 9, 63), TreeBudget(3, 4, 16)),
            Request(2, 0, tuple(range(4, 40)), TreeBudget(1, 1, 1), Sampling(0.7, 0.9, 20, 2**63 - 5)),
        ),
    )
    assert decode_step(encode_step(message)) == message


def test_moves_and_features_round_trip() -> None:
    """Features travel as bfloat16: what arrives is the sender's values rounded to bfloat16."""
    values = torch.randn(3, 6) * 100
    features = Features.of(9, values)
    message = StepMessage(
        releases=(0,),
        moves=((3, 0), (2, 1)),
        requests=(
            Request(0, 4, (5, 9), TreeBudget(), None, features),
            Request(1, 0, (7,), TreeBudget(), Sampling(1.0, 1.0, 0, 3), Features.of(0, values[:1])),
        ),
    )
    back = decode_step(encode_step(message))
    assert back == message
    (first, _) = back.requests
    assert first.features is not None and (first.features.position, first.features.rows) == (9, 3)
    assert torch.equal(first.features.tensor(), values.to(torch.bfloat16))
    assert len(features.values) == 3 * 6 * 2  # two bytes a value


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (StepMessage(moves=((1, 2), (1, 3))), "name a slot twice"),
        (StepMessage(moves=((1, 2), (3, 2))), "name a slot twice"),
        (StepMessage(requests=(Request(0, 0, (5,), TreeBudget(), None, Features(0, 4, b"")),)), "rows"),
        (StepMessage(requests=(Request(0, 0, (5,), TreeBudget(), None, Features(0, 0, b"ab")),)), "width"),
    ],
    ids=["twice-from", "twice-to", "no-rows", "no-width"],
)
def test_bad_moves_and_feature_blocks_are_refused(message: StepMessage, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        decode_step(encode_step(message))


def test_feature_blocks_larger_than_their_frame_are_refused() -> None:
    frame = bytearray(encode_step(StepMessage(requests=(Request(0, 0, (5, 6), TreeBudget(), None,
                                                                Features.of(0, torch.ones(1, 4))),))))  # fmt: skip
    rows_at = len(frame) - 8 - 8  # position, rows, width, then 8 bytes of values
    frame[rows_at : rows_at + 4] = (2**31).to_bytes(4, "little")
    with pytest.raises(ProtocolError, match="do not fit"):
        decode_step(bytes(frame))
    frame = bytearray(encode_step(StepMessage(requests=(Request(0, 0, (5,), TreeBudget()),))))
    frame[10 + 16] = 0x80  # the request's flags byte: a flag this version does not know
    with pytest.raises(ProtocolError, match="unknown request flags"):
        decode_step(bytes(frame))


def test_reply_round_trips_trees_and_rows_bit_exactly() -> None:
    dense = torch.softmax(torch.randn(VOCAB, dtype=torch.float64), -1).float()
    sparse = torch.zeros(VOCAB)
    sparse[[4, 17, 40]] = torch.tensor([0.5, 0.25, 0.25])
    tree = TokenTree((5, 9, 11, 12), (-1, 0, 0, 1))
    reply = StepReply([Drafted(tree, {0: dense, 1: sparse}), Resend(41), Failed("draft cache full")], 0.25)
    back = decode_reply(encode_reply(reply), VOCAB)
    assert back.server_seconds == 0.25
    drafted = back.results[0]
    assert isinstance(drafted, Drafted) and drafted.tree == tree
    assert torch.equal(drafted.draft_probs[0], dense) and torch.equal(drafted.draft_probs[1], sparse)
    assert back.results[1:] == [Resend(41), Failed("draft cache full")]


def test_sparse_rows_are_smaller_than_dense() -> None:
    tree = TokenTree((5, 9), (-1, 0))
    sparse = torch.zeros(VOCAB)
    sparse[9] = 1.0
    dense = torch.full((VOCAB,), 1 / VOCAB)
    size = len(encode_reply(StepReply([Drafted(tree, {0: sparse})])))
    assert size < len(encode_reply(StepReply([Drafted(tree, {0: dense})]))) - VOCAB * 3


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (encode_step(StepMessage(requests=(Request(1, 0, (5, 6), TreeBudget()),)))[:-3], "truncated"),
        (encode_step(StepMessage()) + b"\0", "trailing"),
        (bytes([1, 99]) + bytes(8), "version 99"),
        (encode_reply(StepReply([])) + bytes(2), "kind"),
        (
            encode_step(StepMessage(requests=(Request(1, 0, (5,), TreeBudget()),))).replace(
                b"\x03\x04\x10\x00", b"\x00\x04\x10\x00"
            ),
            "budget",
        ),
    ],
    ids=["truncated", "trailing", "version", "kind", "budget"],
)
def test_malformed_step_frames_are_refused(frame: bytes, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        decode_step(frame)


def test_reply_rows_must_fit_the_vocabulary() -> None:
    row = torch.zeros(VOCAB + 8)
    row[VOCAB + 2] = 1.0
    frame = encode_reply(StepReply([Drafted(TokenTree((5, 9), (-1, 0)), {0: row})]))
    with pytest.raises(ProtocolError, match="vocabulary"):
        decode_reply(frame, VOCAB)


def test_bad_trees_are_refused() -> None:
    frame = bytearray(encode_reply(StepReply([Drafted(TokenTree((5, 9), (-1, 0)))])))
    frame[-6:-2] = (1).to_bytes(4, "little")  # node 1's parent := itself
    with pytest.raises(ProtocolError, match="bad tree"):
        decode_reply(bytes(frame), VOCAB)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://demo-draft:8001", "ws://demo-draft:8001/v1/draft"),
        ("https://d.example:443/", "wss://d.example:443/v1/draft"),
        ("ws://127.0.0.1:9/custom", "ws://127.0.0.1:9/custom"),
    ],
)
def test_websocket_url(url: str, expected: str) -> None:
    assert websocket_url(url) == expected


@pytest.mark.parametrize("url", ["demo-draft:8001", "ftp://x:1", "http://"])
def test_bad_draft_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        websocket_url(url)


def test_fingerprint_tells_vocabularies_apart() -> None:
    same = tokenizer_fingerprint(build_tokenizer())
    assert same == tokenizer_fingerprint(build_tokenizer())
    assert same != tokenizer_fingerprint(build_tokenizer([*WORDS[:-1], "other"]))


def test_hellos() -> None:
    info = ServerInfo("draft", "abc", 64, 256, 4)
    assert ServerInfo.from_json(info.to_json()) == info
    head = ServerInfo("head", "abc", 64, 256, 4, feature_layers=(1, 2, 3), feature_width=192)
    assert ServerInfo.from_json(head.to_json()) == head
    with pytest.raises(ProtocolError, match="protocol 1,"):
        ServerInfo.from_json(ServerInfo("draft", "abc", 64, 256, 4, version=1).to_json())
    nonce = handshake.new_nonce()
    assert handshake.parse_client_hello(handshake.client_hello("pod-1", nonce)) == ClientHello("pod-1", nonce)
    for bad in ('{"version": 2}', '{"client": "a", "version": 2, "nonce": "zz"}', "[]", "nope"):
        with pytest.raises(ProtocolError):
            handshake.parse_client_hello(bad)
    with pytest.raises(ProtocolError, match="1 to 128 characters"):
        handshake.parse_client_hello(handshake.client_hello("x" * 129, nonce))


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"feature_layers": "abc", "feature_width": 3}, "integers"),
        ({"feature_layers": [1, 2.5], "feature_width": 3}, "integers"),
        ({"feature_layers": [-1], "feature_width": 3}, ">= 0"),
        ({"feature_width": 64}, "come together"),
        ({"feature_layers": [1]}, "come together"),
        ({"vocab_size": "64"}, "integers"),
        ({"max_frame_bytes": 0}, ">= 1"),
        ({"feature_layers": 7}, "bad server hello"),
        ({"surprise": 1}, "bad server hello"),
    ],
)
def test_hostile_server_hellos_are_refused(fields: dict, error: str) -> None:
    import json

    raw = json.loads(ServerInfo("draft", "abc", 64, 256, 4).to_json()) | fields
    with pytest.raises(ProtocolError, match=error):
        ServerInfo.from_json(json.dumps(raw))


def test_the_handshake_proves_the_secret_without_sending_it() -> None:
    secret = b"s3cret-of-the-deployment"
    client_nonce, server_nonce = handshake.new_nonce(), handshake.new_nonce()
    challenge = handshake.challenge(server_nonce, client_nonce, secret)
    answer = handshake.answer(client_nonce, server_nonce, secret)
    assert secret.decode() not in challenge + answer
    parsed = handshake.parse_challenge(challenge)
    assert parsed.auth and handshake.verified(secret, "server", server_nonce, client_nonce, parsed.proof)
    claimed = handshake.parse_answer(answer)
    assert handshake.verified(secret, "client", client_nonce, server_nonce, claimed)
    # A proof is bound to its role, both nonces and the secret: none can be reused elsewhere.
    assert not handshake.verified(secret, "client", server_nonce, client_nonce, parsed.proof)
    assert not handshake.verified(secret, "client", client_nonce, handshake.new_nonce(), claimed)
    assert not handshake.verified(b"another", "client", client_nonce, server_nonce, claimed)
    assert not handshake.verified(secret, "client", client_nonce, server_nonce, None)
    open_challenge = handshake.parse_challenge(handshake.challenge(server_nonce, client_nonce, None))
    assert not open_challenge.auth and open_challenge.proof is None


def test_secrets_come_from_a_value_or_a_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    assert handshake.load_secret(None, str(path)) == b"from-a-file"
    assert handshake.load_secret("flag", None) == b"flag"
    assert handshake.load_secret(None, None) is None and handshake.load_secret("", None) is None
    with pytest.raises(ValueError, match="not both"):
        handshake.load_secret("flag", str(path))
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        handshake.load_secret(None, str(path))


def test_the_model_is_announced_by_name_never_by_path() -> None:
    assert model_display_name("/models/cache/org--draft/") == "org--draft"
    assert model_display_name("HuggingFaceTB/SmolLM2-135M") == "SmolLM2-135M"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_fail_with_a_protocol_error(data: bytes) -> None:
    for decode in (decode_step, lambda d: decode_reply(d, VOCAB)):
        with contextlib.suppress(ProtocolError):
            decode(data)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=40), st.integers(0, 200))
def test_corrupted_valid_frames_fail_cleanly(noise: bytes, at: int) -> None:
    features = Features.of(2, torch.ones(2, 3))
    frame = encode_step(
        StepMessage(
            (1,),
            (Commit(2, (0, 1)),),
            (Request(2, 3, (5, 6), TreeBudget(), Sampling(1.0, 0.9, 5, 3), features),),
            ((4, 2),),
        )
    )
    corrupted = frame[: at % len(frame)] + noise + frame[at % len(frame) + len(noise) :]
    with contextlib.suppress(ProtocolError):
        decode_step(corrupted)


def test_values_too_large_for_the_wire_are_refused() -> None:
    with pytest.raises(ProtocolError, match="does not fit"):
        encode_step(StepMessage(requests=(Request(0, 0, (5,), TreeBudget(3, 300, 16)),)))


def test_bad_sampling_settings_are_refused() -> None:
    frame = encode_step(StepMessage(requests=(Request(0, 0, (5,), TreeBudget(), Sampling(1.0, -0.5, 0, 1)),)))
    with pytest.raises(ProtocolError, match="top_p"):
        decode_step(frame)
