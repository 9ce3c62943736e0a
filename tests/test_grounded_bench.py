"""The grounded benchmark measures copying from a request's own input, not from other requests."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "server"))

import grounded  # noqa: E402
import grounded_load  # noqa: E402


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
