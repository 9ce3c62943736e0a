"""Memory planning: the pure plan from numbers, and its wiring into the engine's KV caches."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch
from multiguess.commands.engine_args import add_engine_args
from multiguess.engine import memory_probe
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.eagle3 import Eagle3Drafter
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.memory_plan import (
    UNPLANNED_DEFAULT_LEN,
    DeviceMemory,
    ModelMemory,
    check_utilization,
    plan_memory,
    resolve_max_model_len,
)
from multiguess.errors import EngineConfigError, InsufficientMemoryError
from multiguess.llm import LLM
from multiguess.models.loading import load_model

GIB = 2**30


def model(
    name: str = "target", device: str = "cuda:0", weights: float = 16, act: float = 2, per_token=131072
):
    return ModelMemory(name, device, int(weights * GIB), int(act * GIB), per_token)


def test_sequences_are_what_the_budget_leaves_for_kv() -> None:
    # 80 GiB at 0.9 = 72 GiB; 1 GiB elsewhere, 16 GiB weights, 2 GiB activations leave 53 GiB;
    # a sequence of 8192 tokens at 128 KiB/token is 1 GiB: 53 fit.
    devices = {"cuda:0": DeviceMemory(80 * GIB, 1 * GIB)}
    plan = plan_memory([model()], devices, 0.9, max_batch=256, max_model_len=8192 - 18, capacity=8192)
    assert plan.sequences == 53
    assert plan.devices[0].fits == 53
    assert plan.kv_bytes(plan.models[0]) == 53 * GIB
    capped = plan_memory([model()], devices, 0.9, max_batch=8, max_model_len=8174, capacity=8192)
    assert capped.sequences == 8 and capped.devices[0].fits == 53


def test_scratch_slots_come_out_of_the_sequences() -> None:
    """CUDA graphs' padding rows write into a scratch slot: it takes a sequence's room."""
    devices = {"cuda:0": DeviceMemory(80 * GIB, 1 * GIB)}
    plan = plan_memory([model()], devices, 0.9, 256, 8192 - 18, 8192, scratch_slots=1)
    assert plan.sequences == plan.devices[0].fits == 52


def test_cuda_graphs_pool_and_per_sequence_buffers_come_off_the_room() -> None:
    """A graph pool is held beside the activations; the shared logits buffer and the replay's
    mask grow with the sequences, like their KV caches."""
    devices = {"cuda:0": DeviceMemory(80 * GIB, 1 * GIB)}
    graphed = ModelMemory(
        "target", "cuda:0", 16 * GIB, 2 * GIB, 131072, graph_pool=3 * GIB, graph_bytes_per_sequence=GIB
    )
    plan = plan_memory([graphed], devices, 0.9, 256, 8192 - 18, 8192)
    # 53 GiB as above, less the 3 GiB pool: 50 GiB at 2 GiB a sequence (KV and graph rows).
    assert plan.sequences == 25
    assert plan.graph_bytes(graphed) == 3 * GIB + 25 * GIB
    assert "CUDA graphs 28.00 GiB, KV 25.00 GiB" in plan.lines()[0]


def test_models_on_one_device_share_it_and_activations_do_not_add() -> None:
    devices = {"cuda:0": DeviceMemory(80 * GIB, 0)}
    pair = [model(), model("draft", weights=2, act=1, per_token=131072)]
    plan = plan_memory(pair, devices, 0.9, max_batch=256, max_model_len=8000, capacity=8192)
    # 72 - 18 weights - max(2, 1) activations = 52 GiB; each sequence costs 2 GiB (both caches).
    assert plan.sequences == 26
    assert plan.devices[0].activations == 2 * GIB


def test_the_tightest_device_decides() -> None:
    devices = {"cuda:0": DeviceMemory(80 * GIB, 0), "cuda:1": DeviceMemory(16 * GIB, 0)}
    pair = [model(), model("draft", device="cuda:1", weights=2, act=1, per_token=131072)]
    plan = plan_memory(pair, devices, 1.0, max_batch=256, max_model_len=8000, capacity=8192)
    # cuda:1: 16 - 2 - 1 = 13 sequences; cuda:0: 80 - 18 = 62.
    assert plan.sequences == 13
    assert {d.device: d.fits for d in plan.devices} == {"cuda:0": 62, "cuda:1": 13}


def test_a_paged_cache_is_planned_in_blocks_that_sequences_share() -> None:
    """53 GiB of room at 128 KiB/token (2 MiB blocks of 16) is 27136 blocks, for up to
    ``max_batch`` sequences; a sequence of 8190 tokens takes 512 of them at most."""
    devices = {"cuda:0": DeviceMemory(80 * GIB, 1 * GIB)}
    paged = ModelMemory("target", "cuda:0", 16 * GIB, 2 * GIB, 131072, block_size=16)
    plan = plan_memory([paged], devices, 0.9, max_batch=256, max_model_len=8172, capacity=8190)
    assert plan.sequences == 256 and plan.devices[0].fits == 53
    assert plan.kv_blocks == 27136 and plan.blocks(paged) == (27136, 16)
    assert plan.kv_bytes(paged) == 53 * GIB
    line = plan.lines()[0]
    assert "27136 blocks of 16 tokens = 434176 tokens for up to 256 sequences, 512 blocks each" in line
    draft = ModelMemory("draft", "cuda:0", 2 * GIB, 1 * GIB, 131072, block_size=16)
    pair = plan_memory([paged, draft], devices, 0.9, max_batch=256, max_model_len=8172, capacity=8190)
    assert pair.kv_blocks == (72 - 1 - 18 - 2) * GIB // (2 * 2 * 2**20)  # both models' blocks


def test_a_plan_prints_one_line_per_model() -> None:
    devices = {"cuda:0": DeviceMemory(80 * GIB, 0)}
    plan = plan_memory([model(), model("draft", weights=2)], devices, 0.9, 4, 8000, 8192)
    lines = plan.lines()
    assert len(lines) == 2
    assert lines[0].startswith("memory plan: target on cuda:0: weights 16.00 GiB, activations 2.00 GiB")
    assert "KV 4.00 GiB (4 sequences × 8192 tokens = 32768 tokens" in lines[0]
    assert "room for 26 sequences at utilization 0.9 of 80.00 GiB" in lines[0]
    assert lines[1].startswith("memory plan: draft on cuda:0: weights 2.00 GiB")


def test_no_room_for_one_sequence_is_a_clear_error_with_a_length_that_fits() -> None:
    devices = {"cuda:0": DeviceMemory(24 * GIB, 0)}
    # 21.6 GiB budget - 18 GiB leaves 3.6 GiB: 3.6 GiB / 128 KiB = 29491 tokens, minus the slack.
    with pytest.raises(InsufficientMemoryError, match=r"--max-model-len 29473 or less") as caught:
        plan_memory([model()], devices, 0.9, max_batch=8, max_model_len=131072, capacity=131090)
    assert "less than one sequence's KV cache of 131090 tokens" in str(caught.value)


def test_weights_beyond_the_budget_are_a_clear_error() -> None:
    devices = {"cuda:0": DeviceMemory(16 * GIB, 2 * GIB)}
    with pytest.raises(InsufficientMemoryError, match="leave no room for a KV cache; raise --gpu-memory"):
        plan_memory([model()], devices, 0.9, max_batch=1, max_model_len=1000, capacity=1018)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_utilization_must_be_a_share(value: float) -> None:
    with pytest.raises(EngineConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        check_utilization(value)
    with pytest.raises(EngineConfigError):
        EngineConfig(gpu_memory_utilization=value)
    assert check_utilization(1.0) == 1.0


def test_max_model_len_defaults_to_and_is_bounded_by_the_config() -> None:
    assert resolve_max_model_len(None, 8192, planned=True) == 8192
    assert resolve_max_model_len(None, 8192, planned=False) == UNPLANNED_DEFAULT_LEN
    assert resolve_max_model_len(None, 512, planned=False) == 512
    assert resolve_max_model_len(None, None, planned=True) == UNPLANNED_DEFAULT_LEN
    assert resolve_max_model_len(4096, 8192, planned=False) == 4096
    with pytest.raises(EngineConfigError, match="exceeds the model's own limit of 8192"):
        resolve_max_model_len(8193, 8192, planned=True)


def test_the_engine_bounds_max_model_len_by_the_tiny_models_config(tiny_llama: Path) -> None:
    with pytest.raises(EngineConfigError, match="max_model_len 513 exceeds the model's own limit of 512"):
        LLM(str(tiny_llama), None, dtype="float32", max_model_len=513)
    llm = LLM(str(tiny_llama), None, dtype="float32", adaptive=False)
    assert llm.engine.config.max_model_len == 512  # the config's limit, below the CPU cap
    assert llm.engine.memory_plan is None  # CPUs are not planned
    assert llm.engine.target.capacity == 512 + llm.engine.config.tree_slack


class FixedMeter:
    """A device with a given total memory whose forwards each peak at ``activation`` bytes: the
    probe runners and forwards are real, only the numbers a GPU would report are given."""

    def __init__(self, total: int, activation: int) -> None:
        self.total, self.activation, self.peaks = total, activation, 0

    def device_memory(self, device: torch.device) -> DeviceMemory:
        return DeviceMemory(self.total, 0)

    def peak(self, device: torch.device, run) -> int:
        run()
        self.peaks += 1
        return self.activation


def test_the_engine_sizes_its_kv_caches_from_the_plan(
    tiny_llama: Path,
    tiny_llama_draft: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = load_model(str(tiny_llama), dtype="float32", device="cpu")
    draft = load_model(str(tiny_llama_draft), dtype="float32", device="cpu")
    weights = memory_probe.weight_bytes(target.model, set()) + memory_probe.weight_bytes(draft.model, set())
    # The CPU cache is fp32: 2 layers x (keys + values) x 2 kv heads x 16 dims x 4 B, per model.
    per_token = 2 * 2 * 2 * 16 * 4
    config = EngineConfig(
        3, 4, 16, max_batch=8, max_model_len=200, adaptive=False, gpu_memory_utilization=1.0
    )
    capacity = 200 + config.tree_slack
    # Room for 3 sequences of both models' caches, and a bit.
    total = weights + 1000 + 3 * capacity * 2 * per_token + 100
    meter = FixedMeter(total, activation=1000)
    monkeypatch.setattr(memory_probe, "meter_for", lambda device: meter)
    with caplog.at_level(logging.INFO, logger="multiguess.engine.memory_probe"):
        engine = Engine(target, ModelDrafter(draft), config)
    assert meter.peaks == 4  # a verification forward and a prefill, per model
    plan = engine.memory_plan
    assert plan is not None and plan.sequences == 3
    assert [m.kv_bytes_per_token for m in plan.models] == [per_token, per_token]
    assert engine.config.max_batch == 3
    assert engine.target.cache.kv.shape[1] == 3
    assert engine.drafter.runner.cache.kv.shape[1] == 3
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan:")]
    assert len(lines) == 2 and "3 sequences ×" in lines[0]
    assert any("max_batch 8 lowered to 3" in r.getMessage() for r in caplog.records)
    # The planned engine still decodes.
    from multiguess.params import SamplingParams

    seq = engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(seq.output_ids) == 5


def test_the_plan_counts_cuda_graphs_where_they_run(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With graphs the pool is the verification forward's peak, and each sequence has a row of
    float32 logits and of mask per graph node; the probes also score a prompt chunk for its
    log-probabilities, within the same measured peaks."""
    target = load_model(str(tiny_llama), dtype="float32", device="cpu")
    meter = FixedMeter(2**40, activation=5000)
    monkeypatch.setattr(memory_probe, "meter_for", lambda device: meter)
    config = EngineConfig(max_batch=2, max_model_len=64, adaptive=False, backend="torch", cuda_graphs=True)
    engine = Engine(target, None, config)
    assert meter.peaks == 2
    measured = engine.memory_plan.models[0]
    capacity = 64 + config.tree_slack
    assert measured.graph_pool == 5000
    assert measured.graph_bytes_per_sequence == config.graph_width * (engine.target.vocab_size * 4 + capacity)
    # Without graphs the torch backend pages its cache: a pool of a few blocks, not the meter's terabyte.
    plain_config = EngineConfig(max_batch=2, max_model_len=64, adaptive=False, backend="torch", kv_blocks=16)
    plain = Engine(target, None, plain_config)
    assert plain.memory_plan.models[0].graph_pool == plain.memory_plan.models[0].graph_bytes_per_sequence == 0


def test_the_plan_counts_an_eagle3_heads_cache(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine receives the head's drafter before planning: its cache (one layer, fp32 on a
    CPU) is planned beside the target's, its weights counted (the target's embeddings once), and
    the head's cache holds the planned sequences."""
    from tests.engine.test_eagle3 import random_head

    target = load_model(str(tiny_llama), dtype="float32", device="cpu")
    head = random_head(target.model, 1)
    drafter = Eagle3Drafter(head, target.model.model.embed_tokens)
    meter = FixedMeter(2**40, activation=0)
    monkeypatch.setattr(memory_probe, "meter_for", lambda device: meter)
    engine = Engine(target, drafter, EngineConfig(max_batch=2, max_model_len=64, adaptive=False))
    plan = engine.memory_plan
    assert plan is not None and [m.name for m in plan.models] == ["target", "draft"]
    c = head.config
    assert plan.models[1].kv_bytes_per_token == 2 * c.num_key_value_heads * c.dim * 4
    parameters = sum(p.numel() * p.element_size() for p in head.parameters())
    assert 0 < plan.models[1].weights <= parameters + sum(b.nbytes for b in head.buffers())
    assert drafter.runner.cache.kv.shape[0] == plan.sequences == 2


def test_a_draft_sharing_the_targets_weights_counts_them_once(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = load_model(str(tiny_llama), dtype="float32", device="cpu")
    meter = FixedMeter(2**40, activation=0)
    monkeypatch.setattr(memory_probe, "meter_for", lambda device: meter)
    engine = Engine(target, ModelDrafter(target), EngineConfig(max_batch=2, max_model_len=64, adaptive=False))
    plan = engine.memory_plan
    assert plan is not None
    parameters = sum(p.numel() * 4 for p in target.model.parameters())
    assert parameters <= plan.models[0].weights <= parameters + 4096  # and the rotary tables
    assert plan.models[1].weights == 0


def test_models_that_leave_no_room_fail_before_any_request(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = load_model(str(tiny_llama), dtype="float32", device="cpu")
    meter = FixedMeter(1, activation=0)
    monkeypatch.setattr(memory_probe, "meter_for", lambda device: meter)
    with pytest.raises(InsufficientMemoryError, match="leave no room for a KV cache"):
        Engine(target, None, EngineConfig(max_batch=2, max_model_len=64, adaptive=False))


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    return parser


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_parser().parse_args([]).gpu_memory_utilization == 0.9
    assert engine_parser().parse_args([]).max_model_len is None  # the model's own limit
    assert engine_parser().parse_args(["--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
    monkeypatch.setenv("MULTIGUESS_GPU_MEMORY_UTILIZATION", "0.7")
    assert engine_parser().parse_args([]).gpu_memory_utilization == 0.7
    with pytest.raises(argparse.ArgumentError, match=r"invalid utilization value: '1\.5'"):
        engine_parser().parse_args(["--gpu-memory-utilization", "1.5"])
