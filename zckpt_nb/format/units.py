"""Units and counts, written one way for the whole package: bytes in MiB or GiB, seconds, '3 ranks'."""

from __future__ import annotations

MIB, GIB = 2**20, 2**30


def mib(size: float) -> str:
    """Bytes as MiB with one decimal: mib(3 * 2**20) is '3.0 MiB'."""
    return f"{size / MIB:,.1f} MiB"


def size(n_bytes: float) -> str:
    """Bytes in the unit that suits them: '812 B', '3.0 KiB', '14.3 MiB' (as `mib`), '1.25 GiB'."""
    if abs(n_bytes) >= GIB:
        return f"{n_bytes / GIB:,.2f} GiB"
    if abs(n_bytes) >= MIB:
        return mib(n_bytes)
    return f"{n_bytes / 1024:,.1f} KiB" if abs(n_bytes) >= 1024 else f"{int(n_bytes):,} B"


def secs(seconds: float) -> str:
    """Seconds to 2 decimals under 10 s, 1 above, so a short stage does not round to nothing beside a whole."""
    return f"{seconds:.2f}" if seconds < 10 else f"{seconds:.1f}"


def noun(n: int, word: str) -> str:
    """The noun in the number `n` takes, without `n`: noun(1, "rank") is 'rank', noun(3, "shard") 'shards'."""
    return word if n == 1 else word + "s"


def listed(names: list, shown: int = 3) -> str:
    """The first `shown` of `names`, and how many more: listed(["a", "b", "c"], 1) is 'a and 2 more'."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(map(str, names[:shown])) + more


def counted(n: int, word: str) -> str:
    """`n` and the noun in the number it takes: counted(1, "rank") is '1 rank', counted(3, "shard") '3 shards'."""
    return f"{n:,} {noun(n, word)}"
