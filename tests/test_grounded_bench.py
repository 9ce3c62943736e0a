"""The grounded benchmark measures copying from a request's own input, not from other requests."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "server"))

import grounded  # noqa: E402
import grounded_load  # noqa: E402
import pytest  # noqa: E402
import speculation_bound  # noqa: E402


def test_every_request_but_the_agent_loops_decodes_in_a_scope_of_its_own() -> None:
    """Two prompts of a workload may have the same reply and a load run repeats each prompt:
    sharing a scope would let speculation copy those replies verbatim from the recent index."""
    for workload in grounded.WORKLOADS:
        salts = grounded.cache_salts(workload, "run", 16)
        if workload in grounded.SHARED:
            assert len(set(salts)) == 1
        else:
            assert len(set(salts)) == 16
    assert grounded.cache_salts("code edit", "a", 1) != grounded.cache_salts("code edit", "b", 1)
    assert grounded.cache_salts("code edit", "a", 1) != grounded.cache_salts("extraction", "a", 1)


def test_agent_loop_requests_differ_so_a_load_run_never_repeats_one() -> None:
    """Its replies share tool-call JSON across requests; an identical request would be copied whole."""
    requests = grounded.WORKLOADS["agent loop"]
    assert len(set(requests)) == len(requests) >= 16  # 8 clients x 2 rounds in serving_load.py


def test_each_setup_is_labelled_with_the_weights_its_server_loads() -> None:
    """Plain decoding's ``--drafter none`` is not ``--quantization none``: it serves the default
    weights, as the default setup does."""
    labelled = {name: grounded_load.serves_bf16(flags) for name, flags in grounded_load.SETUPS.items()}
    assert labelled == {
        "plain": False,
        "default": False,
        "model": False,
        "control": False,
        "plain bf16": True,
        "default bf16": True,
    }
    assert {name: grounded_load.reference(name) for name in labelled} == {
        "plain": "plain",
        "default": "plain",
        "model": "plain",
        "control": "plain",
        "plain bf16": "plain bf16",
        "default bf16": "plain bf16",
    }


def test_bound_where_wide_forwards_cost_what_one_row_does_is_the_steps_saved() -> None:
    """A forward of any width costing one row's (a memory-bound GPU's): the bound is plain
    decoding's steps over ``ceil(reply / widest)`` steps, prefill and work around each step
    counted in both."""
    forward = lambda batch, rows: 0.010  # noqa: E731
    perfect = speculation_bound.perfect_steps(100, 1, forward, widest=8, outside=0.002)
    assert perfect == [8] * 13
    got = speculation_bound.bound([0.1], [[1] * 100], [perfect], 1, forward, outside=0.002)
    assert got == pytest.approx((0.1 + 100 * 0.012) / (0.1 + 13 * 0.012))


def test_bound_is_one_where_every_row_costs_the_same_and_nothing_else_does() -> None:
    """Rows priced alike and no fixed cost: no width beats plain decoding, so perfect drafts
    bring nothing; prefill for ``clients`` requests is paid by both."""
    forward = lambda batch, rows: 0.001 * batch * rows  # noqa: E731
    perfect = [speculation_bound.perfect_steps(n, 4, forward, 16, 0.0) for n in (30, 7)]
    plain = [[1] * 30, [1] * 7]
    assert speculation_bound.bound([0.05, 0.2], plain, perfect, 4, forward, 0.0) == pytest.approx(1.0)


def test_perfect_steps_take_the_cheapest_width_not_the_widest() -> None:
    """Past a width whose forward costs a jump (a kernel's tile), narrower trees are cheaper."""
    forward = lambda batch, rows: 0.010 if rows <= 4 else 1.0  # noqa: E731
    assert speculation_bound.perfect_steps(8, 1, forward, widest=16, outside=0.0) == [4, 4]


def test_a_verbatim_copy_is_drafted_a_widest_tree_at_a_time() -> None:
    """The first token has nothing before it to match; after it each step drafts the rest of
    the source up to the widest tree, and the last step only what is left."""
    source = list(range(10, 30))
    assert speculation_bound.copy_steps(source, [source], widest=8) == [1, 8, 8, 3]
    assert speculation_bound.copy_steps([1, 2, 3], [source], widest=8) == [1, 1, 1]  # nothing to copy


def test_copies_follow_the_longest_match_not_the_continuation_that_would_agree() -> None:
    """A copy drafter finds its place by the output's longest suffix; where that place goes on
    otherwise it drafts nothing right, though a shorter match elsewhere would have."""
    sources = [[1, 2, 3, 9, 9, 9], [5, 3, 4, 4, 4]]
    assert speculation_bound.copied_run([1, 2, 3, 4, 4, 4], 3, sources, longest=8) == 0
    assert speculation_bound.copied_run([7, 3, 4, 4, 4], 2, sources, longest=8) == 3


def test_a_reply_copies_its_own_earlier_tokens_once_they_are_out() -> None:
    """The reply before a step is a source too, as far as it is written."""
    assert speculation_bound.copy_steps([7, 8, 9, 7, 8, 9, 7, 8, 9], [], widest=8) == [1, 1, 1, 1, 4, 1]
