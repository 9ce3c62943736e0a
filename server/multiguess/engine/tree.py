"""Token trees: what a drafter proposes and the target verifies in one forward.

Node 0 is the root: the last emitted token, which the target has not seen yet. Every other
node is a drafted token whose parent comes earlier in the list (parents[i] < i), so a tree
can be flattened for the target as-is: tokens, depths (position = cache length + depth) and
an ancestor mask in which each node sees its ancestors and itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a tree needs one parent per token and at least the root")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        depths = [0]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede their children")
            depths.append(depths[p] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...]) -> TokenTree:
        """A linear tree: ordinary (chain) speculation, or a prefill chunk."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        """Whether the nodes form one chain (depths 0..n-1 in order: parents precede children)."""
        return self.depths[-1] == len(self.tokens) - 1

    def paths(self) -> list[tuple[int, ...]]:
        """The drafted tokens from the root down to each node, that node's included (the
        root's path is empty): the text a node's logits condition on beyond the sequence."""
        paths: list[tuple[int, ...]] = [()]
        for i, p in enumerate(self.parents[1:], start=1):
            paths.append((*paths[p], self.tokens[i]))
        return paths

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids


def pack_trees(trees: list[TokenTree], device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Pad a batch of trees to one width for a single forward.

    Returns ``(tokens [B, T], depths [B, T], ancestor mask [B, T, T])``. Padding nodes are
    their own only ancestor (so attention rows never go empty) and are ignored by callers.
    Built from the trees' own lists with a handful of tensor calls: this runs for every
    forward, where a few dozen small tensor ops would cost as much as a draft model's layers.
    A chain (a prefill chunk, a catch-up) is a triangle, and a batch of chains of one length
    (decode steps, a prompt's chunk) is built whole; other trees list each node's ancestors.
    """
    width = max(len(t) for t in trees)
    triangle = torch.ones(width, width, dtype=torch.bool).tril_()
    if all(len(t) == width and t.is_chain for t in trees):
        tokens = torch.tensor([t.tokens for t in trees])
        depths = torch.arange(width).repeat(len(trees), 1)
        return tokens.to(device), depths.to(device), triangle.repeat(len(trees), 1, 1).to(device)
    tokens = torch.tensor([(*t.tokens, *(0,) * (width - len(t))) for t in trees])
    depths = torch.tensor([(*t.depths, *(0,) * (width - len(t))) for t in trees])
    mask = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    seen: list[tuple[int, int, int]] = []  # (tree, node, ancestor) outside any chain's triangle
    for b, tree in enumerate(trees):
        n = len(tree)
        if tree.is_chain:
            mask[b, :n, :n] = triangle[:n, :n]
            continue
        for node, parent in enumerate(tree.parents):
            while parent >= 0:
                seen.append((b, node, parent))
                parent = tree.parents[parent]
    if seen:
        mask[tuple(torch.tensor(seen).T)] = True
    return tokens.to(device), depths.to(device), mask.to(device)
