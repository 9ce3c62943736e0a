"""Structured output: grammar masks along tree paths, lossless under speculation.

The tiny text model (a byte-level tokenizer, ``build_text_tokenizer``) writes garbage, so everything that makes its output valid
JSON, match a regex or be one of the choices is the grammar's doing.
"""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.engine.drafter import DraftRequest, Proposal
from multiguess.engine.drafters.base import Drafter, WrappedDrafter
from multiguess.engine.grammar import Grammars, constrain
from multiguess.engine.tree import TokenTree
from multiguess.errors import InvalidRequestError
from multiguess.params import StructuredOutputsParams
from transformers import AutoTokenizer

from tests.fake_device import FakeDevice
from tests.tiny_models import build_text_tokenizer, build_tokenizer

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,5}-[0-9]{1,3}"
CHOICES = ("yes", "no", "maybe so")
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
}


TOKENIZER = build_text_tokenizer()


def ids(*pieces: str) -> list[int]:
    """Token ids of byte-level spelled tokens (Ġ is a space, Ċ a newline)."""
    found = TOKENIZER.convert_tokens_to_ids(list(pieces))
    assert TOKENIZER.unk_token_id not in found
    return found


def satisfies(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOKENIZER, len(TOKENIZER), frozenset({EOS}))


def test_masks_along_a_tree_equal_masks_after_committing_the_path(grammars: Grammars) -> None:
    """Each node's mask is the mask of a state that emitted the path to it: masking a tree is
    plain constrained decoding at every node, and asking leaves the state as it was."""
    spec, stops = SPECS["json"], frozenset({EOS})
    state = grammars.start(spec, stops)
    for token in ids('{"', "name", '":Ġ', '"'):
        state.advance(token)
    #            0 (root)
    #      1 a        2 "        3 newline (rejected: inside a string)
    #    4 b  5 "   6 ,Ġ"
    #         7 }  (rejected: required properties missing)
    a, quote, newline, b, comma, close = ids("a", '"', "Ċ", "b", ',Ġ"', "}")
    tree = TokenTree((0, a, quote, newline, b, quote, comma, close), (-1, 0, 0, 0, 1, 1, 2, 5))
    got = state.allowed(tree.paths())
    for node, path in enumerate(tree.paths()):
        fresh = grammars.start(spec, stops)
        emitted = ids('{"', "name", '":Ġ', '"') + list(path)
        if fresh.valid_prefix(emitted) < len(emitted):
            assert not got[node].any(), f"node {node}: a rejected path allows nothing"
            continue
        for token in emitted:
            fresh.advance(token)
        assert torch.equal(got[node], fresh.allowed([()])[0]), f"node {node}"
    assert got[0].any() and not got[3].any() and not got[7].any()
    assert torch.equal(state.allowed(tree.paths()), got)
    assert state.valid_prefix(ids("a", '"')) == 2  # the state still sits inside the string


def test_end_of_sequence_only_where_the_grammar_accepts(grammars: Grammars) -> None:
    state = grammars.start(StructuredOutputsParams(regex="[0-9]+"), frozenset({EOS}))
    digit = ids("7")[0]
    rows = state.allowed([(), (digit,)])
    assert not rows[0, EOS] and rows[1, EOS] and rows[1, digit]
    ignoring = grammars.start(StructuredOutputsParams(regex="[0-9]+"), frozenset())
    assert not ignoring.allowed([(digit,)])[0, EOS]  # ignore_eos: the request's stops decide
    choice = grammars.start(StructuredOutputsParams(choice=("ab",)), frozenset({EOS}))
    for token in ids("a", "b"):
        choice.advance(token)
    assert choice.finished  # complete: nothing more, not even end-of-sequence, is asked for


def test_constrain_masks_rows_and_leaves_rows_that_allow_nothing() -> None:
    rows = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    allowed = torch.tensor([[True, False, True], [False, False, False]])
    out = constrain(rows, allowed)
    assert out[0].tolist() == [1.0, float("-inf"), 3.0] and out[1].tolist() == [4.0, 5.0, 6.0]


def test_a_bad_grammar_is_an_invalid_request(grammars: Grammars) -> None:
    with pytest.raises(InvalidRequestError, match="regex"):
        grammars.matcher(StructuredOutputsParams(regex="a(b"))
    with pytest.raises(InvalidRequestError, match="frob"):
        grammars.matcher(StructuredOutputsParams(json={"type": "frob"}))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("a",))


def test_a_tokenizer_without_known_bytes_refuses_grammars() -> None:
    words = build_tokenizer()  # word-level: llguidance cannot tell its tokens' bytes
    grammars = Grammars(words, len(words), frozenset({EOS}))
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            grammars.matcher(StructuredOutputsParams(regex="a"))


class PruningSpy(WrappedDrafter):
    """Wraps a drafter and records every drafted path the grammar rejects (the engine would
    swallow an exception raised here as a draft failure)."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.drafted = 0
        self.rejected: list[tuple[int, ...]] = []

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = self.inner.propose(requests)
        for req, proposal in zip(requests, proposals, strict=True):
            assert req.grammar is not None
            paths = proposal.tree.paths()[1:]
            self.rejected += [p for p in paths if req.grammar.valid_prefix(list(p)) < len(p)]
            self.drafted += len(paths)
        return proposals


PROMPTS = [[5, 9, 14], [30, 31, 8, 60, 61, 12, 40], [7] * 12, [44, 70]]


@pytest.mark.parametrize(
    ("num_candidates", "depth", "drafter"), [(1, 4, "model"), (3, 4, "model"), (3, 3, "ngram")]
)
@pytest.mark.parametrize("kind", list(SPECS))
def test_constrained_greedy_speculation_equals_plain_constrained_decoding(
    tiny_text_llama: Path,
    tiny_text_llama_draft: Path,
    num_candidates: int,
    depth: int,
    drafter: str,
    kind: str,
) -> None:
    params = SamplingParams(max_tokens=96, structured_outputs=SPECS[kind])
    spec = LLM(
        str(tiny_text_llama),
        str(tiny_text_llama_draft) if drafter == "model" else None,
        num_candidates,
        depth,
        dtype="float32",
        adaptive=False,
        drafter=drafter,
    )
    spy = spec.engine.drafter = PruningSpy(spec.engine.drafter)
    plain = LLM(str(tiny_text_llama), None, dtype="float32")
    outs = spec.generate(PROMPTS, params)
    expected = plain.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert all(satisfies(kind, o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert spy.rejected == []
    if drafter == "model":
        assert spy.drafted > 0 and sum(o.stats["accepted_tokens"] for o in outs) > 0
    free = plain.generate(PROMPTS, SamplingParams(max_tokens=96))
    assert not any(satisfies(kind, o.outputs[0].text) for o in free), "the model alone complies"


def test_constrained_sampling_with_speculation_is_seeded_identically(
    tiny_text_llama: Path, tiny_text_llama_draft: Path
) -> None:
    """Seeded samples are a function of the seed: speculative and plain constrained decoding
    give the same tokens, and every sample satisfies the grammar."""
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=4, n=3, structured_outputs=SPECS["json"])
    spec = LLM(str(tiny_text_llama), str(tiny_text_llama_draft), 3, 4, dtype="float32", adaptive=False)
    plain = LLM(str(tiny_text_llama), None, dtype="float32")
    outs = spec.generate(PROMPTS[:2], params)
    expected = plain.generate(PROMPTS[:2], params)
    got = [[c.token_ids for c in o.outputs] for o in outs]
    assert got == [[c.token_ids for c in o.outputs] for o in expected]
    texts = [c.text for o in outs for c in o.outputs]
    assert all(satisfies("json", t) for t in texts) and len(set(texts)) > 1


def test_unseeded_constrained_samples_satisfy_the_grammar(
    tiny_text_llama: Path, tiny_text_llama_draft: Path
) -> None:
    spec = LLM(str(tiny_text_llama), str(tiny_text_llama_draft), 3, 4, dtype="float32", adaptive=False)
    spy = spec.engine.drafter = PruningSpy(spec.engine.drafter)
    params = SamplingParams(
        max_tokens=96, temperature=1.2, top_p=0.95, n=6, structured_outputs=SPECS["regex"]
    )
    outs = spec.generate(PROMPTS[:2], params)
    assert all(satisfies("regex", c.text) for o in outs for c in o.outputs)
    assert spy.drafted > 0 and spy.rejected == []


def test_max_tokens_cuts_a_structured_output_short(tiny_text_llama: Path) -> None:
    llm = LLM(str(tiny_text_llama), None, dtype="float32")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, structured_outputs=SPECS["json"]))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.token_ids) == 3
    assert not satisfies("json", out.outputs[0].text) and out.outputs[0].text.startswith("{")


def test_the_tiny_text_tokenizer_reads_back_as_text(tiny_text_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_llama)
    assert tokenizer.decode(ids('{"', "name", '":Ġ', "1", "}")) == '{"name": 1}'


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_masks_meet_the_logits_on_their_device(
    tiny_text_llama: Path, tiny_text_llama_draft: Path, temperature: float
) -> None:
    """The masks are made on the host and moved to the device of the rows they mask, target's
    and draft's (``tests/fake_device.py`` catches a host tensor meeting a device one)."""
    llm = LLM(str(tiny_text_llama), str(tiny_text_llama_draft), 3, 3, dtype="float32", adaptive=False)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=1, structured_outputs=SPECS["regex"])
    expected = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    mode = FakeDevice()
    with mode:
        mode.adopt(llm)
        outs = llm.generate(PROMPTS[:2], params)
    assert mode.caught == []
    assert [o.token_ids for o in outs] == expected


def test_a_failed_matcher_ends_its_sequence_not_the_engine(grammars: Grammars) -> None:
    state = grammars.start(SPECS["regex"], frozenset({EOS}))
    assert state.error is None
    state.advance(ids("7")[0])  # not allowed: the regex starts with a letter
    assert state.finished and not state.allowed([()]).any()
    assert state.error is not None


# The inputs: none can be followed, and each is refused before admission with why.
UNFOLLOWABLE = {
    "too complex": StructuredOutputsParams(regex="a{1000}{1000}"),
    "matches nothing": StructuredOutputsParams(regex=r"[^\s\S]"),
    "recurses without end": StructuredOutputsParams(grammar='start: start "a"'),
    "at most 1000 choices": StructuredOutputsParams(choice=tuple(f"choice{i}" for i in range(10_000))),
    "accepts no string": StructuredOutputsParams(json={"$ref": "#"}),
    "at most 100000": StructuredOutputsParams(grammar="start: " + " | ".join(['"ab"'] * 20_000)),
}
# Passes the check, then fails within four tokens: "!" starts a 2,500-way alternation, past the
# parser's row limit.
MIDWAY = StructuredOutputsParams(
    grammar='start: /[a-z]{1,3}/ "!" c\nc: ' + " | ".join(f'"v{i}"' for i in range(2500))
)


@pytest.mark.parametrize("why", list(UNFOLLOWABLE))
def test_a_grammar_no_output_can_follow_is_refused_by_the_check(grammars: Grammars, why: str) -> None:
    with pytest.raises(InvalidRequestError, match=why):
        grammars.check(UNFOLLOWABLE[why])


def test_the_check_passes_grammars_that_can_be_followed(grammars: Grammars) -> None:
    for spec in [*SPECS.values(), MIDWAY, StructuredOutputsParams(regex="")]:
        grammars.check(spec)  # the empty regex accepts the empty output
    grammars.check(StructuredOutputsParams(choice=tuple(f"c{i}" for i in range(1000))))


def test_a_matcher_failing_midway_ends_the_sequence_with_an_error(
    tiny_text_llama: Path, tiny_text_llama_draft: Path
) -> None:
    """Plain and speculative decoding alike: finish_reason "error" with why, the output only
    the tokens before the failure (never a "stop" on output the grammar did not complete);
    the other prompts of the batch finish as usual."""
    plain = LLM(str(tiny_text_llama), None, dtype="float32")
    spec = LLM(str(tiny_text_llama), str(tiny_text_llama_draft), 3, 4, dtype="float32", adaptive=False)
    failures = []
    for llm in (plain, spec):
        failed = llm.generate(PROMPTS, SamplingParams(max_tokens=16, structured_outputs=MIDWAY))
        failures.append([o.token_ids for o in failed])
        for out in failed:
            assert out.outputs[0].finish_reason == "error", out.outputs[0]
            assert "too complex" in (out.outputs[0].error or "")
            assert re.fullmatch("[a-z]{0,3}", out.outputs[0].text)
        fine = llm.generate(PROMPTS, SamplingParams(max_tokens=96, structured_outputs=SPECS["regex"]))
        assert all(o.outputs[0].finish_reason == "stop" and o.outputs[0].error is None for o in fine)
    assert failures[0] == failures[1]  # speculation fails where plain decoding does


def test_the_offline_api_refuses_a_grammar_no_output_can_follow(tiny_text_llama: Path) -> None:
    llm = LLM(str(tiny_text_llama), None, dtype="float32")
    for why, grammar in UNFOLLOWABLE.items():
        with pytest.raises(InvalidRequestError, match=why):
            llm.generate(PROMPTS, SamplingParams(max_tokens=8, structured_outputs=grammar))
    assert not llm.engine.has_unfinished()


class MaskFailsAtDepth:
    """A real matcher whose mask fails (as at a resource limit) once ``depth`` tokens have been
    consumed: a failure no small real grammar reaches only in the mask after a token, used to
    check that speculation fails exactly where plain decoding does."""

    def __init__(self, real: Any, depth: int) -> None:
        self._real, self._depth, self._at, self._failed = real, depth, 0, False

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        self._failed |= self._at == self._depth
        self._real.unsafe_compute_mask_ptr(pointer, size)
        if self._failed:  # a failed matcher allows nothing
            ctypes.memset(pointer, 0, size)

    def consume_token(self, token: int) -> bool:
        ok = not self._failed and self._real.consume_token(token)
        self._at += ok
        return ok

    def consume_tokens(self, tokens: list[int]) -> bool:
        return all(self.consume_token(t) for t in tokens)

    def try_consume_tokens(self, tokens: list[int]) -> int:
        consumed = 0 if self._failed else self._real.try_consume_tokens(tokens)
        self._at += consumed
        return consumed

    def rollback(self, count: int) -> bool:
        self._at -= count
        return self._real.rollback(count)

    def is_error(self) -> bool:
        return self._failed or self._real.is_error()

    def get_error(self) -> str:
        return "Parser Error: too many items" if self._failed else self._real.get_error()

    def is_stopped(self) -> bool:
        return self._failed or self._real.is_stopped()

    def is_accepting(self) -> bool:
        return self._real.is_accepting()

    def validate_tokens(self, tokens: list[int]) -> int:
        return 0 if self._failed else self._real.validate_tokens(tokens)


def test_a_mask_failing_past_the_output_fails_speculation_where_plain_decoding_fails(
    tiny_text_llama: Path, tiny_text_llama_draft: Path
) -> None:
    """The mask after the 5th token fails. Speculation meets it early, on a drafted path: that
    must not fail the sequence then, nor let it run past the 5th token (plain decoding fails at
    the 6th, which is dropped)."""
    params = SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-z]{40}"))
    outputs = []
    for llm in (
        LLM(str(tiny_text_llama), None, dtype="float32"),
        LLM(str(tiny_text_llama), str(tiny_text_llama_draft), 3, 4, dtype="float32", adaptive=False),
    ):
        compile_real = llm.engine.grammars.matcher
        llm.engine.grammars.matcher = lambda spec, real=compile_real: MaskFailsAtDepth(real(spec), 5)  # type: ignore[method-assign]
        outs = llm.generate(PROMPTS, params)
        assert all(o.outputs[0].finish_reason == "error" and len(o.token_ids) == 5 for o in outs)
        outputs.append([o.token_ids for o in outs])
    assert outputs[0] == outputs[1]
