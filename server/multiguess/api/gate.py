"""What every request passes before a route sees it: the API key, the content type, the body.

A pure ASGI middleware, so a refused request costs no parsing: a missing or wrong
``Authorization: Bearer <key>`` is a 401 (compared in constant time with every key), and a
right one tags the request with the key's tenant (``tenant_of``), a POST that is not
``application/json`` a 415 (a cross-site form or ``text/plain`` POST never runs), a body
over ``max_body`` bytes a 413, whether it announces its length or streams it, a body that does
not arrive within ``body_timeout`` seconds a 408 (the connection is closed), and a body that
is not UTF-8 JSON text (other encodings, raw surrogate bytes, a lone surrogate escape such as
``"\\ud800"``: text no tokenizer or UTF-8 encoder takes) a 400. The body is read here, up to
the limit, and replayed to the app. Every refusal has the API's JSON error body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from multiguess.api.errors import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

OPEN_PATHS = frozenset({"/health/live", "/health/ready"})
TENANT = "multiguess.tenant"  # the ASGI scope's entry naming the request's tenant (None: no keys)
BODY_TIMEOUT = 30.0  # seconds a request body may take to arrive, from the end of its head
DISCARD_LIMIT = 16  # a refused body is read and dropped up to this many times the limit


class Refused(Exception):
    def __init__(self, status: int, message: str, code: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, list(headers)


def bearer_matches(headers: dict[bytes, bytes], key: bytes) -> bool:
    """``Authorization: Bearer <key>``, as OpenAI clients send it; constant-time compare."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def bearer_tenant(headers: dict[bytes, bytes], keys: Mapping[bytes, str]) -> str | None:
    """The tenant of the key the request carries (None: no valid key). Every key is compared,
    whichever matches, so the time taken does not tell which key, or how many, came first."""
    tenant = None
    for key, owner in keys.items():
        if bearer_matches(headers, key):
            tenant = owner
    return tenant


def tenant_of(scope: Scope) -> str | None:
    """The tenant the gate tagged a request with: its key's, or None when the server has no keys."""
    tenant: str | None = scope.get(TENANT)
    return tenant


def text_problem(body: bytes) -> str | None:
    """Why a body is not UTF-8 JSON text that every part of the server can take, or None.

    ``json.loads`` reads bytes leniently: it guesses UTF-16 or UTF-32 from NUL bytes and decodes
    UTF-8 with ``surrogatepass``, so raw surrogate bytes become lone surrogates that no tokenizer
    or UTF-8 encoder takes. Here the bytes must be strict UTF-8 (which refuses encoded
    surrogates) without NUL bytes (JSON text never holds one raw; UTF-16 and UTF-32 always do),
    and no string, key or value, may decode to a lone surrogate (an escape such as
    ``"\\ud800"``). Only bodies holding a ``\\uD800``-``\\uDFFF`` escape, nearly none, are parsed here.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the request body is not valid UTF-8 (byte {exc.start}): send JSON as UTF-8 text"
    if "\x00" in text:
        return "the request body holds NUL bytes (UTF-16 or UTF-32?): send JSON as UTF-8 text"
    if has_lone_surrogate(text):
        return "the request holds text that is not valid Unicode (a lone surrogate)"
    return None


def has_lone_surrogate(text: str) -> bool:
    """Whether the JSON text holds a string (a key or a value, at any depth) that escapes a
    lone surrogate."""
    if "\\ud" not in text and "\\uD" not in text:  # JSON's escapes spell "u" in lower case
        return False
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return False  # the app reports invalid (or too deep) JSON itself
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def is_json(content_type: bytes) -> bool:
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class RequestGate:
    """``api_keys``: key -> tenant (none: no key is asked for, and every request is tenant None)."""

    def __init__(
        self,
        app: Any,
        max_body: int,
        api_keys: Mapping[str, str] | None = None,
        open_paths: frozenset[str] = OPEN_PATHS,
        body_timeout: float = BODY_TIMEOUT,
    ) -> None:
        if max_body < 1 or not body_timeout > 0:
            raise ValueError("max_body must be >= 1 byte and body_timeout > 0 s")
        self.app, self.max_body, self.open_paths = app, max_body, open_paths
        self.keys = {key.encode(): tenant for key, tenant in (api_keys or {}).items()}
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self.check_headers(scope)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self.read_body(receive)
                receive = replay(body, receive)
        except Refused as refused:
            await respond(send, refused, receive, DISCARD_LIMIT * self.max_body)
            return
        await self.app(scope, receive, send)

    def check_headers(self, scope: Scope) -> None:
        headers = dict(scope["headers"])
        if self.keys and scope["path"] not in self.open_paths:
            scope[TENANT] = bearer_tenant(headers, self.keys)
            if scope[TENANT] is None:
                raise Refused(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    "invalid_api_key",
                    [("www-authenticate", "Bearer")],
                )
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return
        if not is_json(headers.get(b"content-type", b"")):
            raise Refused(
                415,
                "the request body must be JSON: send 'Content-Type: application/json'",
                "unsupported_media_type",
            )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise Refused(413, self.too_large(), "body_too_large")

    async def read_body(self, receive: Receive) -> bytes:
        """The whole body, within ``body_timeout`` seconds of the request head (408 past it)."""
        try:
            async with asyncio.timeout(self.body_timeout):
                return await self.read_chunks(receive)
        except TimeoutError:
            message = f"the request body did not arrive within {self.body_timeout:g} s (--timeout-body)"
            raise Refused(408, message, "body_timeout") from None

    async def read_chunks(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "the client went away before sending the body", "client_gone")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise Refused(413, self.too_large(), "body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                body = b"".join(chunks)
                problem = text_problem(body)
                if problem is not None:
                    raise Refused(400, problem, "invalid_unicode")
                return body

    def too_large(self) -> str:
        return (
            f"the request body is larger than the server's limit of {self.max_body} bytes (--max-body-size)"
        )


def replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then whatever the connection says next (a disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def discard_body(receive: Receive, limit: int) -> None:
    """Read and drop what is left of a refused body, up to ``limit`` bytes; past it the
    connection is closed anyway."""
    read = 0
    while read <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        read += len(message.get("body", b""))


async def respond(send: Send, refused: Refused, receive: Receive, discard_limit: int) -> None:
    """The refusal, sent at once. A 413's response is held open while the rest of the body is
    drained: a server that closes a connection with unread data in it makes the kernel reset
    it, and the reset can destroy the 413 on its way; the server hands out no more of the
    body once a response is complete, so the drain happens before the response ends. A 408's
    body never came: its connection is closed at once."""
    payload = json.dumps(error_body(refused.status, refused.message, code=refused.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in refused.headers]
    if refused.status in (408, 413):
        headers.append((b"connection", b"close"))  # a body unread (or drained up to a limit only)
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": True})
    if refused.status == 413:
        await discard_body(receive, discard_limit)
    await send({"type": "http.response.body", "body": b""})
