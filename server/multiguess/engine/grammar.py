"""Grammar-constrained decoding: which tokens may follow a sequence, at any node of a tree.

A constrained sequence carries a ``GrammarState``: an llguidance matcher advanced along its
output. Speculation needs the allowed tokens after *each node* of a tree, i.e. after the output
plus the path to that node: the state consumes the path, computes the mask and rolls back, so
every node is masked exactly as plain constrained decoding would mask it at that point. The
target's rows are masked that way before sampling, acceptance and log-probabilities; the
drafter prunes its children with the same masks. Why llguidance, with the measurements, is in
docs/API.md (``bench/grammar_engines.py``).

End-of-sequence and the request's stop tokens are allowed only where the grammar accepts; a
grammar that can take no further token ends its sequence (``finished``).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from multiguess.errors import InvalidRequestError
from multiguess.params import StructuredOutputsParams

log = logging.getLogger(__name__)

# Whitespace JSON may hold between two tokens: up to a newline and an indentation, never a
# runaway of blank space (a model that keeps choosing spaces would never finish its object).
JSON_WHITESPACE = r"(\x20|\x0A[\x20\x09]{0,16})?"
_SHIFTS = torch.arange(32, dtype=torch.int32)


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a request's structured output."""
    from llguidance import LLMatcher

    if spec.json is not None or spec.json_object:
        schema: Any = {"type": "object"} if spec.json_object else spec.json
        try:
            return LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_pattern": JSON_WHITESPACE}
            )
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return "start: " + " | ".join(json.dumps(choice) for choice in spec.choice)
    assert spec.grammar is not None
    return LLMatcher.grammar_from_lark(spec.grammar)


class Grammars:
    """Compiles requests' grammars against the target's tokenizer.

    The tokenizer's token-to-bytes table is built on first use (it costs a noticeable fraction
    of a second for a large vocabulary), under a lock: the API checks grammars on its own thread
    while the engine thread starts them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer; a tokenizer whose tokens' bytes it cannot tell
        (a word-level one, a slow one) makes structured output an invalid request."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                eos = sorted(self.eos_ids) or None
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, self.vocab_size, eos)
                except (ValueError, TypeError, AttributeError) as exc:
                    self._tokenizer = (
                        f"structured output needs a tokenizer whose tokens' bytes are known: {exc}"
                    )
            if isinstance(self._tokenizer, str):
                raise InvalidRequestError(self._tokenizer)
            return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher for ``spec``; an ``InvalidRequestError`` saying why it cannot be one."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(), grammar_source(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(matcher.get_error().strip())
        return matcher

    def start(self, spec: StructuredOutputsParams, stop_ids: frozenset[int]) -> GrammarState:
        return GrammarState(self.matcher(spec), self.vocab_size, self.eos_ids, stop_ids)


class GrammarState:
    """A sequence's grammar at the end of its output, and the masks of paths beyond it.

    ``allowed`` is cached per path until the output advances: the drafter and the target ask
    for the same nodes within a step."""

    def __init__(
        self, matcher: Any, vocab_size: int, eos_ids: frozenset[int], stop_ids: frozenset[int]
    ) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        words = (vocab_size + 31) // 32
        self._bits = torch.zeros(words, dtype=torch.int32)
        self._eos = torch.tensor(sorted(t for t in eos_ids if t < vocab_size), dtype=torch.long)
        self._stops = torch.tensor(sorted(t for t in stop_ids if t < vocab_size), dtype=torch.long)
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def finished(self) -> bool:
        """The grammar can take no further token: the output is complete (or the matcher failed)."""
        return bool(self._matcher.is_stopped())

    def advance(self, token: int) -> None:
        """Commit an emitted token (one the masks allowed). Should the matcher fail anyway (it
        stops at resource limits on a pathological grammar), it stays failed, which ``finished``
        reports: the sequence ends, not the engine."""
        if not self._matcher.consume_token(token):
            log.warning("grammar matcher failed at token %d: %s", token, self._matcher.get_error())
        self._cache.clear()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order after the output, the grammar allows."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def allowed(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        """``[len(paths), V]`` booleans (on the host): the tokens allowed after the output
        followed by each path. A path the grammar rejects, or after which it is complete,
        allows nothing."""
        out = torch.zeros(len(paths), self.vocab_size, dtype=torch.bool)
        for i, path in enumerate(paths):
            row = self._cache.get(path)
            if row is None:
                row = self._cache[path] = self._mask_after(path)
            out[i] = row
        return out

    def _mask_after(self, path: tuple[int, ...]) -> torch.Tensor:
        matcher = self._matcher
        consumed = matcher.try_consume_tokens(list(path))
        row = torch.zeros(self.vocab_size, dtype=torch.bool)
        if consumed == len(path) and not matcher.is_stopped():
            matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
            row = ((self._bits[:, None] >> _SHIFTS) & 1).bool().reshape(-1)[: self.vocab_size].clone()
            row[self._eos] = False  # end-of-sequence is the request's to allow, through its stops
            if matcher.is_accepting():
                row[self._stops] = True
        matcher.rollback(consumed)
        return row


def constrain(rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``rows`` (logits after each node) with disallowed tokens at -inf. A row that allows
    nothing is left as it is: its node is never emitted from (the grammar rejected its path,
    or completed before it and ended the sequence), and an all -inf row has no distribution."""
    blocked = ~allowed & allowed.any(dim=-1, keepdim=True)
    return rows.masked_fill(blocked, float("-inf"))
