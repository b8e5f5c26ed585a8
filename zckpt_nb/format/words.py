"""Counted nouns for the sentences the lessons compute: '1 rank', '3 ranks', never 'rank(s)'."""

from __future__ import annotations


def counted(n: int, word: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: counted(1, "rank") is '1 rank', counted(3, "shard") '3 shards'."""
    return f"{n:,} {word if n == 1 else plural or word + 's'}"
