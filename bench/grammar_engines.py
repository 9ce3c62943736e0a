"""Measure the grammar engines structured output could use, on the embedded target's tokenizer.

For llguidance, xgrammar and outlines-core: the tokenizer set-up, the compile time of a JSON
schema, the time of one token mask along a valid document (median and 90th percentile), the
cost of forking a matcher's state and of rolling one token back (what a token tree needs), and
whether generic JSON (``json_object``) is expressible. Every library that is not installed is
skipped with the reason; run it from the repo root with the libraries on the path:
``.venv/bin/python bench/grammar_engines.py`` (it prints JSON with the commit and the machine).
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch
from multiguess.models.embedded import prepare_target
from transformers import AutoTokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["red", "blue"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "01234"},
}
ROUNDS = 20


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def summary(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": round(statistics.median(us), 1), "p90_us": round(us[int(0.9 * (len(us) - 1))], 1)}


def walk(tokens: list[int], mask: Callable[[], None], consume: Callable[[int], None]) -> list[float]:
    """Per-token mask times along ``tokens`` (each token consumed after its mask); the first
    walk of a fresh matcher is reported apart (``first_walk``), since caches warm up."""
    times = []
    for token in tokens:
        times.append(timed(mask)[1])
        consume(token)
    return times


def measured(package: str, setup: float, compile_s: float, times: list[float], walk: int) -> dict[str, Any]:
    """What every engine's row reports: version, setup and compile time, mask times (all, and
    the first walk's ``walk`` tokens)."""
    return {
        "version": version(package),
        "tokenizer_setup_s": round(setup, 3),
        "compile_ms": round(compile_s * 1e3, 2),
        "mask": summary(times),
        "first_walk": summary(times[:walk]),
    }


def fork_and_rollback(
    tokens: list[int],
    consume: Callable[[int], Any],
    fork: Callable[[], Any],
    rollback_one: Callable[[], Any],
) -> dict[str, dict[str, float]]:
    """Times of forking a matcher halfway along ``tokens`` (what a tree's branches need) and of
    consuming one token and rolling it back (what verifying a path needs)."""
    for token in tokens[: len(tokens) // 2]:
        consume(token)
    forks = [timed(fork)[1] for _ in range(200)]
    backs = []
    for _ in range(200):
        consume(tokens[len(tokens) // 2])
        backs.append(timed(rollback_one)[1])
    return {"fork": summary(forks), "rollback_one": summary(backs)}


def llguidance_row(hf: Any, tokens: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf

    tok, setup = timed(lambda: llguidance.hf.from_tokenizer(hf))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(tok, grammar))
    bitmask = torch.zeros((len(hf) + 31) // 32, dtype=torch.int32)

    def mask(m: Any = matcher) -> None:
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    times: list[float] = []
    for _ in range(ROUNDS):
        matcher = llguidance.LLMatcher(tok, grammar)
        times += walk(tokens, lambda m=matcher: mask(m), matcher.consume_token)
        assert matcher.is_accepting() and not matcher.is_error(), matcher.get_error()
    half = llguidance.LLMatcher(tok, grammar)
    branching = fork_and_rollback(tokens, half.consume_token, half.deep_copy, lambda: half.rollback(1))
    json_object = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
    return {
        **measured("llguidance", setup, compile_s, times, len(tokens)),
        **branching,
        "json_object": not json_object.is_error(),
    }


def xgrammar_row(hf: Any, tokens: list[int]) -> dict[str, Any]:
    import xgrammar

    info, setup = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf)))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    bitmask = xgrammar.allocate_token_bitmask(1, len(hf))
    times: list[float] = []
    for _ in range(ROUNDS):
        matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=16)
        times += walk(tokens, lambda m=matcher: m.fill_next_token_bitmask(bitmask), matcher.accept_token)
        assert matcher.is_completed() or matcher.accept_token(info.stop_token_ids[0])
    half = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=16)
    branching = fork_and_rollback(tokens, half.accept_token, half.fork, lambda: half.rollback(1))
    compiler.compile_builtin_json_grammar()
    return {
        **measured("xgrammar", setup, compile_s, times, len(tokens)),
        **branching,
        "json_object": True,
    }


def outlines_row(hf: Any, tokens: list[int]) -> dict[str, Any]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary() -> Any:
        by_bytes: dict[bytes, list[int]] = {}
        for token in range(len(hf)):
            if token == hf.eos_token_id:
                continue
            by_bytes.setdefault(hf.convert_tokens_to_string([hf.convert_ids_to_tokens(token)]).encode(), [])
            by_bytes[hf.convert_tokens_to_string([hf.convert_ids_to_tokens(token)]).encode()].append(token)
        by_bytes.pop(b"", None)
        return outlines_core.Vocabulary(hf.eos_token_id, by_bytes)

    vocab, setup = timed(vocabulary)
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    index, compile_s = timed(lambda: outlines_core.Index(regex, vocab))
    bitmask = torch.zeros((len(hf) + 31) // 32, dtype=torch.int32)
    times: list[float] = []
    for _ in range(ROUNDS):
        guide = outlines_core.Guide(index, max_rollback=16)
        times += walk(
            tokens, lambda g=guide: g.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4), guide.advance
        )
        assert guide.is_finished()
    return {
        **measured("outlines-core", setup, compile_s, times, len(tokens)),
        "fork": "a state is one integer: forking copies it",
        "rollback_one": "rollback_state(n), bounded by max_rollback",
        "json_object": False,
    }


def main() -> None:
    hf = AutoTokenizer.from_pretrained(prepare_target())
    tokens = hf.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    rows: dict[str, Any] = {}
    for name, row in (
        ("llguidance", llguidance_row),
        ("xgrammar", xgrammar_row),
        ("outlines-core", outlines_row),
    ):
        try:
            rows[name] = row(hf, tokens)
        except ImportError as exc:
            rows[name] = {"skipped": str(exc)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(
        json.dumps(
            {
                "commit": commit.strip(),
                "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
                "command": ".venv/bin/python bench/grammar_engines.py",
                "vocabulary": len(hf),
                "document_tokens": len(tokens),
                "engines": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
