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

A grammar is checked before its request is admitted (``Grammars.check``): it must be within the
size limits, compile within ``parser_limits()``, accept some finite string, and survive its first
token. A matcher that fails later
all the same (a resource limit deep in the output) reports ``error``: the sequence ends with
that error, never as if the output were complete.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
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

# Limits on what a request may ask for (docs/API.md lists them). Choices: OpenAI's cap on enum
# values in a strict schema; more alternatives than llguidance's row limit could not be matched.
MAX_CHOICES = 1000
MAX_SOURCE_CHARS = 100_000  # a regex, a Lark grammar, or all the choices together
ACCEPTS_NOTHING = "the grammar accepts no string: it matches nothing, or it recurses without end"


def parser_limits() -> Any:
    """llguidance's resource limits for every matcher, stated rather than left implicit. They
    bound the work of one mask (fuel, Earley items) and the lexer's memory; errors stay terse
    (no parser-state dumps, which would echo the grammar into responses and logs)."""
    from llguidance import LLParserLimits

    return LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        verbose_errors=False,
    )


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
    check_size(spec)
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return "start: " + " | ".join(json.dumps(choice) for choice in spec.choice)
    assert spec.grammar is not None
    return LLMatcher.grammar_from_lark(spec.grammar)


def check_size(spec: StructuredOutputsParams) -> None:
    """Refuse a regex, Lark grammar or choice list past the documented limits (a JSON schema is
    bounded by the request body's limit)."""
    if spec.choice is not None and len(spec.choice) > MAX_CHOICES:
        raise InvalidRequestError(f"at most {MAX_CHOICES} choices are allowed, got {len(spec.choice)}")
    text = spec.regex if spec.regex is not None else spec.grammar
    size = len(text) if text is not None else sum(len(c) for c in spec.choice or ())
    if size > MAX_SOURCE_CHARS:
        raise InvalidRequestError(
            f"the grammar is {size} characters long; at most {MAX_SOURCE_CHARS} are allowed"
        )


def matcher_error(matcher: Any) -> str | None:
    """The matcher's error in a line a client can read (None: it has not failed)."""
    if not matcher.is_error():
        return None
    message = matcher.get_error().replace("<non-verbose/>", "").strip()
    if message.startswith("NoExtension"):
        return ACCEPTS_NOTHING
    if "too many" in message or "max is" in message or "fuel" in message:
        return f"the grammar is too complex for the grammar engine's limits: {message.splitlines()[0]}"
    return message


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

        matcher = LLMatcher(self._llg_tokenizer(), grammar_source(spec), log_level=0, limits=parser_limits())
        error = matcher_error(matcher)
        if error is not None:
            raise InvalidRequestError(error)
        return matcher

    def check(self, spec: StructuredOutputsParams) -> None:
        """Refuse, before admission, a grammar that would fail its request: one that does not
        compile, accepts no finite string (its first mask is llguidance's NoExtension, or allows
        nothing where the grammar is not complete), or exceeds a limit on its first token (the
        lexer or parser limits are met as soon as a long repetition or a wide alternation starts
        to be matched). Costs a compile and two masks, at most the lexer's initial fuel."""
        state = self.start(spec, frozenset())
        first = state.allowed([()])[0]
        error = state.error
        if error is None and not first.any() and not state.accepting:
            error = ACCEPTS_NOTHING
        if error is None and first.any():
            state.advance(int(first.nonzero()[0, 0]))
            state.allowed([()])
            error = state.error
        if error is not None:
            raise InvalidRequestError(error)

    def start(self, spec: StructuredOutputsParams, stop_ids: frozenset[int]) -> GrammarState:
        return GrammarState(lambda: self.matcher(spec), self.vocab_size, self.eos_ids, stop_ids)


class GrammarState:
    """A sequence's grammar at the end of its output, and the masks of paths beyond it.

    ``allowed`` is cached per path until the output advances: the drafter and the target ask
    for the same nodes within a step.

    A drafted path on which the matcher fails (a resource limit) must not fail the sequence:
    plain decoding would fail only on reaching it. The path allows nothing, and the matcher,
    which never leaves an error, is rebuilt from ``build`` and the output; should the output
    reach a path whose mask failed, the next token fails, as it does in plain decoding."""

    def __init__(
        self,
        build: Callable[[], Any],
        vocab_size: int,
        eos_ids: frozenset[int],
        stop_ids: frozenset[int],
    ) -> None:
        self._build = build
        self._matcher = build()
        self._output: list[int] = []  # the tokens committed, to rebuild the matcher from
        self._failed: set[tuple[int, ...]] = set()  # drafted paths whose mask failed
        self._doomed = False  # the output reached such a path
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

    @property
    def accepting(self) -> bool:
        """The output so far is a complete string of the grammar."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        """Why the matcher failed (None: it has not): the sequence ends with this error."""
        return matcher_error(self._matcher)

    def advance(self, token: int) -> None:
        """Commit an emitted token (one the masks allowed). Should the matcher fail anyway (it
        stops at resource limits on a pathological grammar), it stays failed, which ``error``
        reports: the sequence ends with an error, not the engine."""
        if self._doomed:
            self._mask_after(())  # fails as plain decoding's mask here did: so does the token
        if self._matcher.consume_token(token):
            self._output.append(token)
        else:
            log.warning("grammar matcher failed at token %d: %s", token, self.error)
        self._failed = {path[1:] for path in self._failed if path[:1] == (token,)}
        self._doomed = () in self._failed
        self._cache.clear()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order after the output, the grammar allows (none where
        checking them met a limit: they are only drafted)."""
        if self._matcher.is_error():
            return 0
        valid = int(self._matcher.validate_tokens(list(tokens)))
        if self._matcher.is_error():
            self._rebuild()
            return 0
        return valid

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
        row = torch.zeros(self.vocab_size, dtype=torch.bool)
        if matcher.is_error():  # failed at the output itself: nothing follows, on any path
            return row
        consumed = matcher.try_consume_tokens(list(path))
        if consumed == len(path) and not matcher.is_stopped():
            matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
            row = ((self._bits[:, None] >> _SHIFTS) & 1).bool().reshape(-1)[: self.vocab_size].clone()
            row[self._eos] = False  # end-of-sequence is the request's to allow, through its stops
            if matcher.is_accepting():
                row[self._stops] = True
        if path and matcher.is_error():  # a drafted path met a limit: it allows nothing
            if consumed == len(path):
                self._failed.add(path)
            self._rebuild()
            return torch.zeros_like(row)
        matcher.rollback(consumed)
        return row

    def _rebuild(self) -> None:
        """A fresh matcher at the end of the output (the failed one stays failed)."""
        self._matcher = self._build()
        self._matcher.consume_tokens(self._output)


def constrain(rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``rows`` (logits after each node) with disallowed tokens at -inf. A row that allows
    nothing is left as it is: its node is never emitted from (the grammar rejected its path,
    or completed before it and ended the sequence, or failed there and fails the token after
    it), and an all -inf row has no distribution."""
    blocked = ~allowed & allowed.any(dim=-1, keepdim=True)
    return rows.masked_fill(blocked, float("-inf"))
