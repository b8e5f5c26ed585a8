"""Counted nouns for the sentences the lessons compute: '1 rank', '3 ranks', never 'rank(s)'."""

from __future__ import annotations


def noun(n: int, word: str, plural: str | None = None) -> str:
    """The noun in the number `n` takes, without `n`: noun(1, "rank") is 'rank', noun(3, "shard") 'shards'."""
    return word if n == 1 else plural or word + "s"


def counted(n: int, word: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: counted(1, "rank") is '1 rank', counted(3, "shard") '3 shards'."""
    return f"{n:,} {noun(n, word, plural)}"
