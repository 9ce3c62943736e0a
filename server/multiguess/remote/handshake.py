"""The draft protocol's handshake: who is connecting, and proof that both sides hold the secret.

Three JSON text frames precede the first step:

1. client -> server ``{"client": id, "version": 1, "nonce": c}``
2. server -> client ``{"nonce": s, "auth": bool, "proof": HMAC(secret, "server", c, s)}``
3. client -> server ``{"proof": HMAC(secret, "client", s, c)}``

then the server announces itself (``ServerInfo``). With a shared secret each side proves it
knows the secret over the other's fresh nonce, so the secret never travels and a recorded
handshake cannot be replayed; a server with a secret refuses a client without it, and a client
with a secret refuses a server that cannot prove it (a rogue draft server). Without a secret the
proofs are null and the frames only carry the nonces. Pure functions; the server and the client
do the I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from multiguess.remote.protocol import VERSION, ProtocolError

NONCE_BYTES = 16
MAX_CLIENT_ID = 128


class AuthenticationFailed(ProtocolError):
    """The peer could not prove it holds the draft secret (or one side has none)."""


@dataclass(frozen=True)
class ClientHello:
    client: str  # the client's own name for itself: for logs, never a key to another's state
    nonce: str


@dataclass(frozen=True)
class Challenge:
    nonce: str
    auth: bool
    proof: str | None


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def proof(secret: bytes, role: str, own_nonce: str, peer_nonce: str) -> str:
    """What ``role`` ("server" or "client") sends: an HMAC binding both nonces, in its order."""
    message = "\n".join(("multiguess-draft", str(VERSION), role, peer_nonce, own_nonce)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verified(secret: bytes, role: str, own_nonce: str, peer_nonce: str, claimed: object) -> bool:
    """Whether ``claimed`` is ``role``'s proof; compared in constant time."""
    if not isinstance(claimed, str):
        return False
    expected = proof(secret, role, own_nonce, peer_nonce)
    return hmac.compare_digest(expected.encode(), claimed.encode())


def _object(text: str | bytes, what: str) -> dict:
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"bad {what}: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"bad {what}: not a JSON object")
    return value


def _nonce(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES or not _is_hex(value):
        raise ProtocolError(f"bad {what}: the nonce must be {2 * NONCE_BYTES} hex digits")
    return value


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def client_hello(client_id: str, nonce: str) -> str:
    return json.dumps({"client": client_id, "version": VERSION, "nonce": nonce})


def parse_client_hello(text: str | bytes) -> ClientHello:
    hello = _object(text, "client hello")
    client, version = hello.get("client"), hello.get("version")
    if version != VERSION:
        raise ProtocolError(f"client speaks protocol {version!r}, this server {VERSION}")
    if not isinstance(client, str) or not 0 < len(client) <= MAX_CLIENT_ID:
        raise ProtocolError(f"bad client hello: the client id must be 1 to {MAX_CLIENT_ID} characters")
    return ClientHello(client, _nonce(hello.get("nonce"), "client hello"))


def challenge(nonce: str, client_nonce: str, secret: bytes | None) -> str:
    signed = proof(secret, "server", nonce, client_nonce) if secret is not None else None
    return json.dumps({"nonce": nonce, "auth": secret is not None, "proof": signed})


def parse_challenge(text: str | bytes) -> Challenge:
    body = _object(text, "server challenge")
    claimed = body.get("proof")
    return Challenge(
        _nonce(body.get("nonce"), "server challenge"),
        body.get("auth") is True,
        claimed if isinstance(claimed, str) else None,
    )


def answer(nonce: str, server_nonce: str, secret: bytes | None) -> str:
    signed = proof(secret, "client", nonce, server_nonce) if secret is not None else None
    return json.dumps({"proof": signed})


def parse_answer(text: str | bytes) -> object:
    """The client's claimed proof (None when it has no secret)."""
    return _object(text, "client answer").get("proof")


def load_secret(value: str | None, path: str | None, flag: str = "--draft-secret") -> bytes | None:
    """A secret from ``flag`` or the file ``flag``-file names (a mounted Kubernetes Secret: one
    trailing newline is not part of it); None when neither is set."""
    if value and path:
        raise ValueError(f"give {flag} or {flag}-file, not both")
    if path:
        text = Path(path).read_text(encoding="utf-8")
        value = text[:-1] if text.endswith("\n") else text
        if not value:
            raise ValueError(f"the file {path} given as {flag}-file is empty")
    return value.encode() if value else None
