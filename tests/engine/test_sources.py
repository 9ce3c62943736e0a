"""The per-source policy: a copy draft worth at least the model's tree replaces it."""

from __future__ import annotations

from multiguess.engine.adaptive import ForwardCost
from multiguess.engine.sources import better_copy, copy_worth, model_drafts, model_worth

GENTLE = ForwardCost((1, 2, 4, 8, 16, 32), (1.0, 1.05, 1.1, 1.3, 1.6, 2.4))


def test_a_copy_is_worth_its_best_prefix_per_forward_cost() -> None:
    sure = (0.95,) * 32
    assert copy_worth((), GENTLE, 1, 33) == 1.0
    assert copy_worth(sure, ForwardCost(), 1, 33) == 1 + sum(sure)  # rows are free: all of it
    assert copy_worth(sure, ForwardCost(), 1, 5) == 1 + sum(sure[:4])  # within the limit
    # Steep rows: the one-node prefix (plain decoding) beats any copy of unsure guesses.
    assert copy_worth((0.1, 0.05), ForwardCost((1, 64), (1.0, 64.0)), 1, 33) == 1.0
    best = copy_worth(sure, GENTLE, 1, 33)
    assert best > copy_worth(sure[:4], GENTLE, 1, 33) and best >= (1 + sum(sure)) / GENTLE(33)


def test_the_model_drafts_only_where_its_tree_is_worth_more_than_the_copy() -> None:
    tree = model_worth(2.8, 4, 4, GENTLE, 1, 0.05, 0.1)
    assert tree == 2.8 / (GENTLE.growth(1, 5) + 0.05 + 0.4)
    long_match = copy_worth((0.95,) * 32, GENTLE, 1, 33)
    short_match = copy_worth((0.3, 0.1), GENTLE, 1, 33)
    assert not model_drafts(long_match, tree)  # the copy covers what the model would guess
    assert model_drafts(short_match, tree) and model_drafts(None, tree)


def test_the_copy_worth_more_is_chosen() -> None:
    assert better_copy([None, None]) is None
    assert better_copy([1.5, None]) == 0
    assert better_copy([1.5, 2.5]) == 1
    assert better_copy([2.0, 2.0]) == 0  # a tie keeps the prediction, listed first
