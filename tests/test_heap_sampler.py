"""The heap sampler sees a save shorter than its coarsest interval (notebook 06's routes save in about 30 ms)."""

import time

import pytest

from zckpt_nb.measure.meters import heap_in_use, measure


@pytest.mark.fast
def test_a_buffer_held_for_20_ms_and_freed_inside_the_save_is_seen():
    if heap_in_use() is None:
        pytest.skip("no glibc mallinfo2 here: the heap is not measured")

    def save() -> None:  # 32 MiB built, held 20 ms, freed before the save returns: below the 50 ms interval
        buffer = bytearray(32 * 2**20)
        time.sleep(0.02)
        del buffer

    cost = measure("probe", save, written=list)
    assert cost.heap_extra_peak_bytes >= 32 * 2**20
