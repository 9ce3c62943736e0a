"""Per-request generation parameters (mirrors vLLM's ``SamplingParams``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from multiguess.errors import InvalidRequestError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows

# Who may reuse whose KV: a request reuses cached prefixes only of requests with an equal scope.
CacheScope: TypeAlias = tuple[str | None, str | None]  # (tenant, cache_salt)
SHARED_SCOPE: CacheScope = (None, None)  # no tenant, no salt: what the Python API's requests share


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's ``StructuredOutputsParams``); exactly one of:
    ``json``, a JSON schema (a dict, kept as its JSON text so the params stay hashable);
    ``regex``, which the whole output matches; ``choice``, strings the output is one of;
    ``grammar``, a Lark grammar (llguidance's dialect); ``json_object``, any JSON object.
    The engine compiles and applies it (``engine/grammar.py``)."""

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError("choice must be a non-empty list of strings")
        given = [self.json is not None, self.regex is not None, self.choice is not None]
        given += [self.grammar is not None, self.json_object]
        if sum(given) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of json, regex, choice, grammar, json_object"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature=0`` is greedy: token-identical to plain greedy decoding.

    ``num_candidates``/``depth`` override the engine's tree budget for this request; ``depth=0``
    disables speculation for it. ``stop`` strings end generation and are not returned.
    Penalties and bias change the target's logits before sampling (``engine/penalties.py``):
    ``presence_penalty``/``frequency_penalty`` over the generated tokens (OpenAI's),
    ``repetition_penalty`` over prompt and generated tokens (vLLM's, 1 is off), ``logit_bias``
    per token id, and ``min_tokens`` bars end-of-sequence and stop tokens until that many were
    generated. ``logprobs`` (None: off) records each generated token's log-probability and
    that many alternatives. ``structured_outputs`` constrains the output to a grammar.
    ``prompt_logprobs`` (vLLM's; None: off) records the log-probability of every prompt token
    after the first, under the target's raw distribution, and that many alternatives.
    ``tenant`` (the server sets it from the API key) and ``cache_salt`` (vLLM's, per request)
    scope the prefix cache: a request reuses KV only of requests with the same pair
    (``cache_scope``), so neither its output's timing nor ``cached_tokens`` tells anything
    about prompts sent under another scope. None and None: the one shared scope.
    ``prediction`` (OpenAI's predicted outputs): the text or token ids the reply is expected to
    be, such as the file a code edit rewrites; drafts follow it (``engine/prediction.py``), so a
    right prediction makes the reply faster and a wrong one costs a draft, never the output.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    num_candidates: int | None = None
    depth: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    tenant: str | None = None
    cache_salt: str | None = None
    prediction: str | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.prediction is not None and not isinstance(self.prediction, str):
            object.__setattr__(self, "prediction", tuple(int(t) for t in self.prediction))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = dict(self.logit_bias)  # stored as sorted (token, bias) pairs: the params stay hashable
        object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in bias.items())))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (all(self.stop), "stop strings must not be empty"),
            (
                self.num_candidates is None or self.num_candidates >= 1,
                f"num_candidates must be at least 1, got {self.num_candidates}",
            ),
            (self.depth is None or self.depth >= 0, f"depth must be >= 0, got {self.depth}"),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}",
            ),
            (
                all(-100 <= b <= 100 for _, b in self.logit_bias),  # type: ignore[misc]
                "logit_bias values must be in [-100, 100]",
            ),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (
                self.cache_salt is None or (isinstance(self.cache_salt, str) and bool(self.cache_salt)),
                "cache_salt must be a non-empty string if given",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def cache_scope(self) -> CacheScope:
        """The prefix cache's sharing key: requests reuse each other's KV only when it is equal
        (also the key for anything else shared across requests, such as a suffix index)."""
        return (self.tenant, self.cache_salt)

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, bias or ``min_tokens`` change the target's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )
