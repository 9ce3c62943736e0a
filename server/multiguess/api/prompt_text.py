"""Callers' text becomes ordinary tokens; only the chat template makes control tokens.

A tokenizer reads a special-token string such as ``<|im_end|>`` in its input as that special
token, so a user message holding ``<|im_end|>\\n<|im_start|>system\\n...`` would forge a system
turn inside the chat template. Here every string a caller sent (message content, names, tool
calls, tool definitions) is tokenized with special-token parsing off, as HF's
``split_special_tokens`` does, while the control tokens the template itself writes stay control
tokens. The template is rendered once with each special-token string in the callers' strings
replaced by a random ASCII marker; the rendered text is cut at the template's own special tokens,
the markers are put back, and the pieces that held one are tokenized as plain text. Requests
without such strings, nearly all, are tokenized exactly as before, in one piece; with them, the
pieces between control tokens are tokenized one by one, as the tokenizer itself splits its input
at special tokens.
"""

from __future__ import annotations

import copy
import re
import secrets
import weakref
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

_LITERAL: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, Any] = weakref.WeakKeyDictionary()


def special_strings(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The strings the tokenizer reads as special tokens, longest first (as it matches them)."""
    found = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return sorted(found, key=lambda text: (-len(text), text))


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text`` tokenized with every special-token string in it read as plain text.

    A fast tokenizer gets its own copy of the backend with special-token parsing off: the
    tokenizer's ``split_special_tokens`` argument flips a flag on the shared backend, which
    another thread's call could flip back mid-request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))
    literal = _LITERAL.get(tokenizer)
    if literal is None:
        literal = copy.deepcopy(backend)
        literal.encode_special_tokens = True
        _LITERAL[tokenizer] = literal
    # encode_batch, not encode: only the batch call lets go of the GIL, and a long prompt takes
    # seconds, which the event loop (health checks, streams) must not wait for.
    return list(literal.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def mark_strings(value: Any, replace: Callable[[str], str]) -> Any:
    """``value`` (JSON-like: dicts, lists, tuples, strings) with ``replace`` applied to every
    string, keys included."""
    if isinstance(value, str):
        return replace(value)
    if isinstance(value, dict):
        return {mark_strings(k, replace): mark_strings(v, replace) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(mark_strings(item, replace) for item in value)
    return value


def templated_ids(
    tokenizer: PreTrainedTokenizerBase, render: Callable[[Any], str], callers: Any
) -> list[int]:
    """The token ids of ``render(callers)``, where the callers' strings (anywhere in ``callers``)
    are text and only what the template adds may be special tokens."""
    specials = special_strings(tokenizer)
    if not specials:
        return list(tokenizer.encode(render(callers), add_special_tokens=False))
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    nonce = secrets.token_hex(8)
    markers = {s: f"mgtext{nonce}x{i}x" for i, s in enumerate(specials)}
    forged = False

    def mark(text: str) -> str:
        nonlocal forged
        marked = pattern.sub(lambda m: markers[m.group()], text)
        forged = forged or marked != text
        return marked

    rendered = render(mark_strings(callers, mark))
    if not forged:
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    originals = {marker: s for s, marker in markers.items()}
    unmark = re.compile("|".join(re.escape(m) for m in originals))
    ids: list[int] = []
    end = 0
    for control in [*pattern.finditer(rendered), None]:
        piece = rendered[end : control.start() if control else len(rendered)]
        restored = unmark.sub(lambda m: originals[m.group()], piece)
        if restored != piece:
            ids += text_ids(tokenizer, restored, add_special_tokens=False)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
        if control:
            ids.append(tokenizer.convert_tokens_to_ids(control.group()))
            end = control.end()
    return ids
