"""convert.prefetch: items come in order, at most `slots` are out at once, a read's error reaches the caller."""

import threading

import pytest

from zckpt_nb.convert.prefetch import Prefetch


@pytest.mark.fast
def test_prefetch_hands_out_in_order_with_at_most_slots_items_out() -> None:
    out, most, lock = set(), 0, threading.Lock()

    def read(key: int) -> int:
        nonlocal most
        with lock:
            out.add(key)
            most = max(most, len(out))
        return key * 10

    reader = Prefetch(read, range(20), slots=2)
    got = []
    for key in range(20):
        with lock:
            out.difference_update(range(key))  # done with every item before this one, as `get` is told
        got.append(reader.get(key))
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
    assert not reader.thread.is_alive()
    early = Prefetch(lambda k: k, range(1000))
    early.get(0)
    early.close()
    assert not early.thread.is_alive()
