"""Token trees: structure, flattening (tokens, depths, ancestor mask) and the attention mask."""

import pytest
import torch
from multiguess.engine.placement import region_attention_mask
from multiguess.engine.tree import TokenTree, pack_trees


def path_to(tree: TokenTree, node: int) -> list[int]:
    """Node indices from the root down to ``node``, walking parents: the reference the batched
    masks are checked against."""
    path = [node]
    while tree.parents[path[-1]] != -1:
        path.append(tree.parents[path[-1]])
    return path[::-1]


def ancestor_mask(tree: TokenTree) -> torch.Tensor:
    """One tree's ``[n, n]`` ancestor-or-self mask, as ``pack_trees`` builds it."""
    return pack_trees([tree])[2][0]


def test_depths_children_and_paths() -> None:
    #        0
    #      1   2
    #     3 4   5
    #           6
    tree = TokenTree((10, 11, 12, 13, 14, 15, 16), (-1, 0, 0, 1, 1, 2, 5))
    assert tree.depths == (0, 1, 1, 2, 2, 2, 3)
    assert tree.children() == [[1, 2], [3, 4], [5], [], [], [6], []]
    assert path_to(tree, 6) == [0, 2, 5, 6]
    assert tree.max_depth == 3


def test_ancestor_mask_is_ancestors_and_self() -> None:
    tree = TokenTree((1, 2, 3, 4), (-1, 0, 0, 2))
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(ancestor_mask(tree), expected)


def test_chain_is_causal() -> None:
    tree = TokenTree.chain([5, 6, 7])
    assert tree.parents == (-1, 0, 1)
    assert torch.equal(ancestor_mask(tree), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


@pytest.mark.parametrize(
    ("tokens", "parents"),
    [((), ()), ((1, 2), (-1,)), ((1, 2), (0, 0)), ((1, 2, 3), (-1, 2, 0)), ((1, 2), (-1, 1))],
)
def test_malformed_trees_are_refused(tokens: tuple, parents: tuple) -> None:
    with pytest.raises(ValueError):
        TokenTree(tokens, parents)


def test_pack_trees_pads_with_self_only_rows() -> None:
    tokens, depths, mask = pack_trees([TokenTree.chain([1]), TokenTree((4, 5, 6), (-1, 0, 0))])
    assert tokens.tolist() == [[1, 0, 0], [4, 5, 6]]
    assert depths.tolist() == [[0, 0, 0], [0, 1, 1]]
    assert mask[0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert mask[1, 2].tolist() == [True, False, True]


def test_region_mask_sees_prefix_and_visible_region_only() -> None:
    # Sequence 0: prefix of 2, a region of 3 tree nodes; row 1 sees region nodes 0 and 1.
    visible = torch.tensor([[[True, False, False], [True, True, False]]])
    mask = region_attention_mask(torch.tensor([2]), visible, length=6)
    assert mask.shape == (1, 1, 2, 6)
    assert mask[0, 0, 0].tolist() == [True, True, True, False, False, False]
    assert mask[0, 0, 1].tolist() == [True, True, True, True, False, False]


def random_tree(generator: torch.Generator, size: int) -> TokenTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]
    return TokenTree(tuple(range(100, 100 + size)), tuple(parents))


def test_packed_masks_and_depths_agree_with_paths_for_random_trees() -> None:
    generator = torch.Generator().manual_seed(0)
    trees = [random_tree(generator, int(n)) for n in torch.randint(1, 33, (12,), generator=generator)]
    trees[3:3] = [TokenTree.chain(range(7, 27)), TokenTree.chain([9])]  # chains take a faster path
    chains = [TokenTree.chain(range(i, i + 9)) for i in range(3)]  # ...and a batch of them another
    for batch in (trees, chains, [TokenTree.chain([5])] * 4):
        tokens, depths, mask = pack_trees(batch)
        for b, tree in enumerate(batch):
            n = len(tree)
            assert tokens[b, :n].tolist() == list(tree.tokens)
            assert depths[b, :n].tolist() == list(tree.depths)
            for node in range(n):
                assert mask[b, node].nonzero().flatten().tolist() == sorted(path_to(tree, node))
            assert torch.equal(mask[b, n:, n:], torch.eye(mask.shape[1] - n, dtype=torch.bool))
            assert not mask[b, n:, :n].any()
