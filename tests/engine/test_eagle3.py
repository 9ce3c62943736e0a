"""The EAGLE-3 drafter: what it drafts over its KV cache is what training taught the head.

Heads here are random (built in the test) on tiny random targets; the checks are exact
relations, not acceptance: the drafter's chained nodes equal the training-time-test forward
(same positions, keys and features), and the engine's output with the EAGLE-3 drafter is the
target's own, token for token (greedy) and in distribution (sampling).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.distill.eagle3_train import HeadBatch, build_head, frozen_embedding, ttt_hidden
from multiguess.drafting import Serving
from multiguess.engine.backends.cpu.backend import CpuBackend
from multiguess.engine.drafter import DraftRequest, TreeBudget
from multiguess.engine.drafters.eagle3 import Eagle3Drafter
from multiguess.engine.drafters.growing import Candidate, Level
from multiguess.engine.eagle3_head import default_aux_layers
from multiguess.errors import IncompatibleDraftError, UnsupportedModelError
from multiguess.models.eagle3_checkpoint import save_head
from transformers import AutoModelForCausalLM

from tests.drafters import eagle3_drafter
from tests.engine.test_sampling_exact import (
    ALPHA,
    LENGTH,
    SAMPLES,
    SETTINGS,
    chi_square_pvalue,
    draw,
    exact_distribution,
)
from tests.tiny_models import build_tokenizer, model_config, save_model


@pytest.fixture(scope="module")
def tiny_target() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config("llama", 64, num_hidden_layers=5)).eval()


def random_head(target: torch.nn.Module, seed: int, vocab: torch.Tensor | None = None):
    head = build_head(target, torch.arange(64) if vocab is None else vocab, seed)
    with torch.no_grad():  # weights far from the target's, so every part of the math shows
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    return head.eval()


def target_features(target: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    layers = default_aux_layers(target.config.num_hidden_layers)
    with torch.no_grad():
        states = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


def test_chained_nodes_equal_the_training_time_test_forward(tiny_target: torch.nn.Module) -> None:
    """A node d levels below the root, fed its parent's output feature at position n - 2 + d,
    has the output (and logits) of training step d at the root's row; the root's row is step 0."""
    head = random_head(tiny_target, 1)
    embed = frozen_embedding(tiny_target)
    ids = torch.randint(4, 64, (14,), generator=torch.Generator().manual_seed(2))
    feats = target_features(tiny_target, ids)
    steps = 3
    no_labels = torch.zeros(1, len(ids), dtype=torch.bool)
    batch = HeadBatch(ids[None], feats[None], torch.tensor([len(ids)]), torch.zeros(1, 14, 1, dtype=torch.long),
                      torch.zeros(1, 14, 1), no_labels, no_labels)  # fmt: skip
    with torch.no_grad():
        outs = ttt_hidden(head, embed, batch, steps, pad_id=3)
    for j in (0, 5, 9):  # the root is x[j + 1]: positions 0..j carry target features
        drafter = eagle3_drafter(head, embed, 2, 64)
        drafter.add_features(1, 0, feats[: j + 1])
        request = DraftRequest(1, ids[: j + 2].tolist(), TreeBudget(1, steps, steps))
        root_logits, prefixes = drafter._catch_up([request])
        torch.testing.assert_close(drafter._hidden[0][-1], outs[0][0, j], atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(root_logits[0], head.logits(outs[0][0, j]), atol=1e-3, rtol=1e-4)
        cands: list[Candidate] = []
        fed: list[dict[int, int]] = [{}]
        for depth in range(1, steps):
            cands.append(Candidate(int(ids[j + 1 + depth]), len(cands) - 1, 0.0, 0, True, depth))
            (rows,) = drafter._feed(Level([request], prefixes, [[len(cands) - 1]], [cands], fed))
            torch.testing.assert_close(
                drafter._hidden[0][len(cands) - 1], outs[depth][0, j], atol=1e-3, rtol=1e-4
            )
            torch.testing.assert_close(rows[0], head.logits(outs[depth][0, j]), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_drafting_form_of_the_head_computes_its_training_form(
    tiny_target: torch.nn.Module, dtype: torch.dtype
) -> None:
    """``for_drafting`` swaps the head's linears for the CPU backend's fused, repacked ones (in
    bf16 multiguess's panels, norms and residuals inside the kernel): the same layer, to
    rounding; before the swap every module's weight trains."""
    head = random_head(tiny_target, 5).to(dtype)
    c = head.config
    gen = torch.Generator().manual_seed(6)
    embeds = torch.randn(2, 3, c.hidden_size, generator=gen).to(dtype)
    features = torch.randn(2, 3, len(c.aux_layers) * c.target_hidden_size, generator=gen).to(dtype)
    positions = torch.arange(3)[None].expand(2, 3)

    def layer() -> tuple[torch.Tensor, torch.Tensor]:
        hidden = head.fuse(features)
        q, k, v = head.qkv(embeds, hidden, head.rope(embeds, positions))
        attended = q + (k * v).sum() / k.numel()  # any [B, H, T, d] that depends on all three
        out = head.finish(attended, hidden)
        return out, head.logits(out)

    trained_out, trained_logits = layer()
    trained_logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters() if p.requires_grad)
    head.zero_grad()
    with torch.no_grad():
        head.for_drafting(CpuBackend(dtype, eager=False).projection)
        out, logits = layer()
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    torch.testing.assert_close(out, trained_out.detach(), **tolerance)
    torch.testing.assert_close(logits, trained_logits.detach(), **tolerance)


def test_features_that_do_not_continue_start_the_sequence_afresh(tiny_target: torch.nn.Module) -> None:
    head = random_head(tiny_target, 3)
    drafter = eagle3_drafter(head, frozen_embedding(tiny_target), 1, 64)
    ids = torch.randint(4, 64, (10,), generator=torch.Generator().manual_seed(4))
    feats = target_features(tiny_target, ids)
    request = DraftRequest(0, ids.tolist(), TreeBudget(2, 2, 4))
    (nothing,) = drafter.propose([request])  # no features yet: the root alone
    assert nothing.tree.tokens == (int(ids[-1]),)
    drafter.add_features(0, 0, feats[:3])
    with pytest.raises(RuntimeError, match="no target features"):  # they stop short of the root
        drafter.propose([request])
    drafter.release(0)
    drafter.add_features(0, 0, feats[:4])
    drafter.add_features(0, 6, feats[6:9])  # a gap: positions 4 and 5 were never handed over
    assert drafter.base[0] == drafter.cached[0] == 6
    (proposal,) = drafter.propose([request])
    assert proposal.tree.tokens[0] == int(ids[-1]) and 1 < len(proposal.tree) <= 5
    assert drafter.cached[0] == len(ids) - 1


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight tokens: a random head's guesses land often enough that accepted paths are tested."""
    folder = tmp_path_factory.mktemp("eagle3-target")
    tokenizer = build_tokenizer([f"w{i}" for i in range(4)])
    target = save_model(
        folder / "target", model_config("llama", len(tokenizer), num_hidden_layers=4), 11, tokenizer
    )
    with torch.no_grad():  # a flatter target: sampled outcomes spread over many continuations
        model = AutoModelForCausalLM.from_pretrained(target)
        model.lm_head.weight.mul_(0.25)
        model.save_pretrained(target)
    return target


def saved_head(target: Path, folder: Path, seed: int, vocab: list[int] | None = None) -> Path:
    """A random head written in the ecosystem's layout, read back by the engine's loader."""
    model = AutoModelForCausalLM.from_pretrained(target)
    ids = torch.arange(model.config.vocab_size) if vocab is None else torch.tensor(vocab)
    save_head(random_head(model, seed, ids), folder, torch.float32)
    return folder


def plain_outputs(target: Path, prompts: list[list[int]], dtype: str, max_tokens: int) -> list[list[int]]:
    llm = LLM(str(target), None, dtype=dtype, drafter="none")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("num_candidates", "depth", "adaptive"), [(1, 4, False), (3, 3, False), (2, 2, False), (3, 4, True)]
)
def test_greedy_output_is_the_targets_own(
    small_vocab_target: Path, tmp_path: Path, num_candidates: int, depth: int, adaptive: bool
) -> None:
    """Chains and trees, a batch of prompts of different lengths (one of a single token), fixed
    trees and the adaptive policy (observation probes): token for token plain decoding."""
    head = saved_head(small_vocab_target, tmp_path / "head", seed=12)
    prompts = [[5, 6, 7, 4, 5, 6], [7], [4, 4, 5, 7, 6, 5, 4, 7, 7, 6, 5]]
    llm = LLM(str(small_vocab_target), str(head), num_candidates, depth, dtype="float32",
              drafter="eagle3", adaptive=adaptive)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs(small_vocab_target, prompts, "float32", 20)
    stats = llm.engine.totals
    assert stats.accepted_tokens > 0 and stats.fallback_steps == 0  # guesses landed; none failed
    assert isinstance(llm.engine.drafter, Eagle3Drafter)


def test_greedy_bf16_output_is_plain_bf16_decoding(gqa_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """In bf16 on the CPU kernels (where the machine has them) the tree's rows are bit-identical
    to one-token steps, so speculation with the head equals plain bf16 decoding exactly."""
    target, _ = gqa_pair
    head = saved_head(target, tmp_path / "head", seed=13)
    prompts = [[5, 9, 13, 21, 8], [30, 11, 17]]
    llm = LLM(str(target), str(head), 3, 3, dtype="bfloat16", drafter="eagle3", adaptive=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs(target, prompts, "bfloat16", 16)
    assert llm.engine.totals.fallback_steps == 0


@pytest.mark.parametrize(
    ("vocab", "setting", "seed"),
    [(None, "t1", None), (None, "t1", 19), ([1, 4, 6, 7], "t1.3-topp0.8", None)],
)
def test_sampling_matches_the_target_exactly(
    small_vocab_target: Path, tmp_path: Path, vocab: list[int] | None, setting: str, seed: int | None
) -> None:
    """The chi-square test of ``test_sampling_exact`` with the EAGLE-3 drafter's trees, over
    the whole vocabulary and over a draft vocabulary of half the tokens (d2t): unseeded samples
    verify sampled children by rejection, seeded ones by their fixed noise."""
    head = saved_head(small_vocab_target, tmp_path / "head", seed=14, vocab=vocab)
    params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, n=SAMPLES, seed=seed, **SETTINGS[setting])
    llm = LLM(
        str(small_vocab_target),
        str(head),
        3,
        2,
        dtype="float32",
        max_batch=256,
        drafter="eagle3",
        adaptive=False,  # every sequence drafts the full tree, whatever the policy would plan
    )
    samples = draw(llm, params)
    assert len(samples) == SAMPLES and llm.engine.totals.accepted_tokens > 0
    pvalue = chi_square_pvalue(samples, exact_distribution(small_vocab_target, params))
    assert pvalue > ALPHA, f"{vocab}/{setting}: p = {pvalue:.2e}"


def test_a_head_for_another_target_is_refused(
    small_vocab_target: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    head = saved_head(small_vocab_target, tmp_path / "head", seed=15)
    with pytest.raises(IncompatibleDraftError, match="made for another target"):
        LLM(str(tiny_llama), str(head), dtype="float32", drafter="eagle3")
    with pytest.raises(UnsupportedModelError, match="is an EAGLE-3 head"):
        LLM(str(small_vocab_target), str(head), dtype="float32", drafter="model")


def test_eagle3_drafting_stays_on_the_device(small_vocab_target: Path, tmp_path: Path) -> None:
    """Captured features, the head's cache and its trees meet only tensors of their own device
    (``tests/fake_device.py``), greedy and sampled, with the same greedy tokens."""
    from tests.engine.test_device_hygiene import SAMPLED, on_device, token_ids

    head = saved_head(small_vocab_target, tmp_path / "head", seed=16)
    llm = LLM(str(small_vocab_target), str(head), 3, 3, dtype="float32", drafter="eagle3", adaptive=False)
    prompts = [[5, 6, 7, 4, 5], [7, 6]]
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = token_ids(llm.generate(prompts, greedy))
    got, caught = on_device(llm, lambda: token_ids(llm.generate(prompts, greedy)))
    assert caught == [] and got == expected
    for params in SAMPLED:
        _, caught = on_device(llm, lambda p=params: llm.generate(prompts, p))
        assert caught == [], params
    assert llm.engine.totals.fallback_steps == 0 and llm.engine.totals.accepted_tokens > 0


def test_the_cli_chooses_the_eagle3_drafter(
    small_vocab_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from multiguess import cli
    from multiguess.errors import ModelLoadError
    from multiguess.models.eagle3_checkpoint import SHIPPED_HEAD, embedded_head

    head = saved_head(small_vocab_target, tmp_path / "head", seed=17)
    common = ["generate", "--prompt", "w1 w2 w3 w0", "--target", str(small_vocab_target), "--dtype", "float32",
              "--max-tokens", "12", "--no-adaptive"]  # fmt: skip
    assert cli.main([*common, "--drafter", "none"]) == 0
    plain = capsys.readouterr().out
    assert cli.main([*common, "--drafter", "eagle3", "--draft", str(head)]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert json.loads(captured.err.strip().splitlines()[-1])["draft_tokens"] > 0
    with pytest.raises(SystemExit, match="--target needs --draft"):
        cli.main([*common, "--drafter", "eagle3"])
    if not SHIPPED_HEAD.exists():
        with pytest.raises(ModelLoadError, match="no EAGLE-3 head ships for the embedded target"):
            embedded_head()


def test_the_servers_guard_passes_features_through(small_vocab_target: Path, tmp_path: Path) -> None:
    """``serve`` wraps the drafter in ``GuardedDrafter``: features still reach the head."""
    from multiguess.engine.guard import GuardedDrafter

    head = saved_head(small_vocab_target, tmp_path / "head", seed=18)
    llm = LLM(str(small_vocab_target), str(head), 3, 3, dtype="float32", drafter="eagle3", adaptive=False,
              serving=Serving())  # fmt: skip
    assert isinstance(llm.engine.drafter, GuardedDrafter)
    prompts = [[5, 6, 7, 4, 5], [7]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs(small_vocab_target, prompts, "float32", 12)
    assert llm.engine.totals.accepted_tokens > 0 and not llm.engine.drafter.degraded
