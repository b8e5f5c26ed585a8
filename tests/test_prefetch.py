"""convert.prefetch: items come in order, the next is read while the caller holds one (two out at most), a read's
error reaches the caller."""

import threading
import time

import pytest

from zckpt_nb.convert.prefetch import Prefetch


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("zckpt-prefetch")]


@pytest.mark.fast
def test_prefetch_hands_out_in_order_reads_one_ahead_and_holds_at_most_two_items() -> None:
    out, most, lock = set(), 0, threading.Lock()

    def read(key: int) -> int:
        nonlocal most
        with lock:
            out.add(key)
            most = max(most, len(out))
        return key * 10

    reader = Prefetch(read, range(20))
    got = []
    for key in range(20):
        with lock:
            out.difference_update(range(key))  # done with every item before this one, as `get` is told
        got.append(reader.get(key))
        deadline = time.monotonic() + 30  # a bounded wait for an event, not a timing
        while key < 19 and key + 1 not in out and time.monotonic() < deadline:
            time.sleep(0.001)
        assert key == 19 or key + 1 in out, f"item {key + 1} was not read while the caller held item {key}"
    reader.close()
    assert got == [k * 10 for k in range(20)] and most <= 2


@pytest.mark.fast
def test_prefetch_raises_the_read_error_at_its_get_and_close_stops_the_reader() -> None:
    def read(key: int) -> int:
        if key == 2:
            raise OSError("disk gone")
        return key

    reader = Prefetch(read, range(5))
    assert reader.get(0) == 0 and reader.get(1) == 1
    with pytest.raises(OSError, match="disk gone"):
        reader.get(2)
    reader.close()
    early = Prefetch(lambda k: k, range(1000))
    early.get(0)
    with pytest.raises(RuntimeError, match="prefetch order"):
        early.get(5)
    early.close()
    assert not prefetch_threads()
