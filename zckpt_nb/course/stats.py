"""The exact permutation test notebook 06 teaches in its cells, kept here for notebook 09, which reuses it (the same
code: tests/test_course.py checks that the two agree)."""

from __future__ import annotations

import itertools


def wins(a: list[float], b: list[float]) -> float:
    """How many of the pairs (x from a, y from b) a wins: x shorter than y (a tie counts one half)."""
    return sum((x < y) + 0.5 * (x == y) for x in a for y in b)


def chance(a: list[float], b: list[float]) -> float:
    """The share of all splits of the pooled stalls into groups of len(a) and len(b) whose score is at least as far
    from an even split as the measured one: both directions, so 'A faster' and 'B faster' are tested alike."""
    pooled, even = a + b, len(a) * len(b) / 2
    measured = abs(wins(a, b) - even)
    splits = list(itertools.combinations(range(len(pooled)), len(a)))
    as_far = 0
    for chosen in splits:
        group = [pooled[i] for i in chosen]
        rest = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        as_far += abs(wins(group, rest) - even) >= measured
    return as_far / len(splits)
