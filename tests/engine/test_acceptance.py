"""Acceptance rules on hand-made trees."""

import torch
from multiguess.engine.acceptance import accept_greedy, accept_sampled
from multiguess.engine.drafter import DraftRequest, SampleSpec, TreeBudget
from multiguess.engine.drafters.growing import Candidate, Level, TreeGrower, select_nodes
from multiguess.engine.sampling import Generators, NodeDistributions, Processing
from multiguess.engine.tree import TokenTree
from multiguess.engine.verifier import NodeArgmax

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


def test_node_argmax_is_torchs_argmax_row_by_row() -> None:
    rows = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    rows[1, [3, 700]] = 50.0  # equal maxima: the first
    rows[2, [10, 20]] = float("nan")  # NaN wins, the first
    rows[3] = float("-inf")
    for table in (rows, rows.to(torch.bfloat16), rows[:, ::2]):
        choices = NodeArgmax(table)
        assert [choices[i] for i in range(len(table))] == table.argmax(dim=-1).tolist()


def test_greedy_acceptance_reads_the_rows_of_its_path_only() -> None:
    read: list[int] = []

    class Reads(NodeArgmax):
        def __getitem__(self, node: int) -> int:
            read.append(node)
            return super().__getitem__(node)

    rows = torch.zeros(5, 10)
    rows[0, 6] = rows[2, 8] = rows[4, 3] = 1.0  # the path of the first test, by its rows
    assert accept_greedy(TREE, Reads(rows)).tokens == [6, 8, 3]
    assert read == [0, 2, 4]


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


def test_an_unseeded_sample_keeps_the_same_places_of_its_tree_whatever_it_drew() -> None:
    """With the same draft distribution after every node, which drawn children a sampled tree
    keeps (its parents, in creation order) is the same for every draw: the beam and the budget
    choose by draw rank, never by the probability of the token drawn, which would leave the
    kept children no longer draws from q and bias acceptance. Seeded trees choose by it."""
    vocab = 12
    logits = torch.linspace(0.0, 4.0, vocab)[None]  # far from flat: drawn tokens' q differ
    grower = TreeGrower(None, vocab)

    def feed(level: Level) -> list[torch.Tensor]:
        return [logits.expand(len(beam), vocab) for beam in level.beams]

    def shapes(coupled: bool) -> set[tuple[int, ...]]:
        found = set()
        for seed in range(30):
            sample = SampleSpec(Processing(1.0), Generators(seed), coupled=coupled)
            request = DraftRequest(0, [1, 2, 3], TreeBudget(4, 3, 9), sample)
            tree = grower.grow([request], logits, [0], feed)[0].proposal.tree
            assert len(tree) == 10
            found.add(tree.parents)
        return found

    assert len(shapes(coupled=False)) == 1
    assert len(shapes(coupled=True)) > 1  # where own probabilities choose, the places vary
