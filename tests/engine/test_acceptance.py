"""Acceptance rules on hand-made trees."""

import torch
from multiguess.engine.acceptance import accept_greedy, accept_sampled
from multiguess.engine.drafters.growing import Candidate, select_nodes
from multiguess.engine.sampling import NodeDistributions, Processing
from multiguess.engine.tree import TokenTree

#        0 (root, token 9)
#      1(a=5)   2(b=6)
#     3(7)       4(8)
TREE = TokenTree((9, 5, 6, 7, 8), (-1, 0, 0, 1, 2))


def test_greedy_follows_the_matching_child_and_adds_a_bonus() -> None:
    # Target argmax after each node: root -> 6, node 2 -> 8, node 4 -> 3.
    result = accept_greedy(TREE, [6, 0, 8, 0, 3])
    assert result.path == [0, 2, 4]
    assert result.tokens == [6, 8, 3]
    assert result.accepted_drafts == 2


def test_greedy_rejecting_everything_emits_the_target_token() -> None:
    result = accept_greedy(TREE, [1, 0, 0, 0, 0])
    assert result.path == [0]
    assert result.tokens == [1]


def test_greedy_root_only_tree_is_plain_decoding() -> None:
    assert accept_greedy(TokenTree.chain([4]), [2]).tokens == [2]


def test_sampled_with_point_mass_target_is_deterministic() -> None:
    logits = torch.full((5, 10), float("-inf"))
    for node, token in enumerate([6, 0, 8, 0, 3]):
        logits[node, token] = 0.0
    for processing in (Processing(1.0), Processing(0.7, top_p=0.9)):  # raced and kept-set draws
        result = accept_sampled(
            TREE, NodeDistributions(logits, processing), {}, torch.Generator().manual_seed(0)
        )
        assert result.tokens == [6, 8, 3]


def test_select_nodes_keeps_tree_connected_and_sibling_prefixes() -> None:
    cands = [
        Candidate(1, -1, -0.1, 0),  # 0: child of root
        Candidate(2, -1, -3.0, 1),  # 1: second child of root (low score)
        Candidate(3, -1, -0.2, 2),  # 2: third child: needs 1 first
        Candidate(4, 0, -0.3, 0),  # 3: child of 0
    ]
    assert select_nodes(cands, 2) == [0, 3]
    assert select_nodes(cands, 3) == [0, 1, 3]
    assert select_nodes(cands, 4) == [0, 1, 2, 3]


def test_select_nodes_always_keeps_the_spine() -> None:
    cands = [
        Candidate(1, -1, -0.1, 0, spine=True),  # 0
        Candidate(2, -1, -0.2, 1),  # 1
        Candidate(3, 0, -5.0, 0, spine=True),  # 2: improbable, but chain speculation drafts it
        Candidate(4, 1, -0.3, 0),  # 3
    ]
    assert select_nodes(cands, 2) == [0, 2]
    assert select_nodes(cands, 3) == [0, 1, 2]
