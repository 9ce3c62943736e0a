"""The EAGLE-3 drafter: what it drafts over its KV cache is what training taught the head.

Heads here are random (built in the test) on tiny random targets; the checks are exact
relations, not acceptance: the drafter's chained nodes equal the training-time-test forward
(same positions, keys and features), and the engine's output with the EAGLE-3 drafter is the
target's own, token for token (greedy) and in distribution (sampling).
"""

from __future__ import annotations

import pytest
import torch
from multiguess.distill.eagle3_train import HeadBatch, build_head, frozen_embedding, ttt_hidden
from multiguess.engine.drafter import DraftRequest, TreeBudget, _Candidate
from multiguess.engine.eagle3 import Eagle3Drafter, HeadRunner
from multiguess.engine.eagle3_head import default_aux_layers
from transformers import AutoModelForCausalLM

from tests.tiny_models import model_config


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
        drafter = Eagle3Drafter(HeadRunner(head, embed, num_slots=2, capacity=64))
        drafter.add_features(1, 0, feats[: j + 1])
        request = DraftRequest(1, ids[: j + 2].tolist(), TreeBudget(1, steps, steps))
        root_logits, prefixes = drafter._catch_up([request])
        torch.testing.assert_close(drafter._hidden[0][-1], outs[0][0, j], atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(root_logits[0], head.logits(outs[0][0, j]), atol=1e-3, rtol=1e-4)
        cands: list[_Candidate] = []
        fed: list[dict[int, int]] = [{}]
        for depth in range(1, steps):
            cands.append(_Candidate(int(ids[j + 1 + depth]), len(cands) - 1, 0.0, 0, True, depth))
            (rows,) = drafter._feed([request], prefixes, [[len(cands) - 1]], [cands], fed)
            torch.testing.assert_close(
                drafter._hidden[0][len(cands) - 1], outs[depth][0, j], atol=1e-3, rtol=1e-4
            )
            torch.testing.assert_close(rows[0], head.logits(outs[depth][0, j]), atol=1e-3, rtol=1e-4)


def test_features_that_do_not_continue_start_the_sequence_afresh(tiny_target: torch.nn.Module) -> None:
    head = random_head(tiny_target, 3)
    drafter = Eagle3Drafter(HeadRunner(head, frozen_embedding(tiny_target), num_slots=1, capacity=64))
    ids = torch.randint(4, 64, (10,), generator=torch.Generator().manual_seed(4))
    feats = target_features(tiny_target, ids)
    request = DraftRequest(0, ids.tolist(), TreeBudget(2, 2, 4))
    with pytest.raises(RuntimeError, match="no target features"):
        drafter.propose([request])
    drafter.add_features(0, 0, feats[:4])
    drafter.add_features(0, 6, feats[6:9])  # a gap: positions 4 and 5 were never handed over
    assert drafter.base[0] == drafter.cached[0] == 6
    (proposal,) = drafter.propose([request])
    assert proposal.tree.tokens[0] == int(ids[-1]) and 1 < len(proposal.tree) <= 5
    assert drafter.cached[0] == len(ids) - 1
