"""Prompt lookup over token lists: continuations of earlier occurrences of a sequence's own
suffix (``find_continuations``), merged into a tree (``trie``), and grafting one tree onto
another (``graft``, which the engine does with copy drafts). The ``ngram`` drafter
(``drafters/ngram.py``) drafts with the first two.
"""

from __future__ import annotations

import numpy as np

from multiguess.engine.matching import match_lengths
from multiguess.engine.tree import TokenTree


def find_continuations(
    tokens: list[int], depth: int, limit: int, max_ngram: int, min_ngram: int
) -> list[list[int]]:
    """Up to ``limit`` continuations (at most ``depth`` long) of earlier matches of the suffix.

    Longer matching suffixes come first, then more recent occurrences; continuations whose
    first token repeats an earlier one's are skipped so that branches differ.
    """
    if len(tokens) < 2:
        return []
    seq = np.asarray(tokens)
    found: list[list[int]] = []
    firsts: set[int] = set()
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # where an earlier match of any suffix ends
    lengths = match_lengths(seq, ends, seq, max_ngram)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        for end in ends[lengths >= n][::-1]:
            cont = seq[end + 1 : end + 1 + depth].tolist()
            if cont and cont[0] not in firsts:
                firsts.add(cont[0])
                found.append(cont)
                if len(found) == limit:
                    return found
    return found


def trie(root: int, chains: list[list[int]], max_nodes: int) -> TokenTree:
    """Merge chains that share prefixes into one tree under ``root``; parents stay first."""
    tokens, parents = [root], [-1]
    index: dict[tuple[int, int], int] = {}
    for chain in chains:
        node = 0
        for token in chain:
            key = (node, token)
            if key not in index:
                if len(tokens) - 1 == max_nodes:
                    break
                tokens.append(token)
                parents.append(node)
                index[key] = len(tokens) - 1
            node = index[key]
    return TokenTree(tuple(tokens), tuple(parents))


def graft(
    tree: TokenTree, other: TokenTree, reach: tuple[float, ...], max_new: int
) -> tuple[TokenTree, tuple[float, ...]]:
    """``tree`` with ``other`` (whose root is ``tree``'s) grafted under its root: each of
    ``other``'s nodes along the node of ``tree`` that already spells it, else as a new node
    (at most ``max_new``) appended after the tree's own in ``other``'s order, so the original
    nodes keep their indices and a grafted node's descendants are grafted; with the ``reach``
    (one per node of ``other`` but its root) of the appended nodes."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    child = {(parent, tokens[i]): i for i, parent in enumerate(parents) if parent >= 0}
    at = [0]  # node of the grafted tree each of other's nodes became
    appended: list[float] = []
    for i in range(1, len(other)):
        parent = at[other.parents[i]]
        key = (parent, other.tokens[i])
        if key not in child:
            if len(appended) == max_new or parent < 0:
                at.append(-1)  # dropped, and its descendants with it
                continue
            tokens.append(other.tokens[i])
            parents.append(parent)
            child[key] = len(tokens) - 1
            appended.append(reach[i - 1])
        at.append(child[key])
    return TokenTree(tuple(tokens), tuple(parents)), tuple(appended)
