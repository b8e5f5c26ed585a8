"""The committed save's file writer: O_DIRECT blocks, SHA-256 on a thread of its own, the tail, errors, no CRC-32."""

import errno
import hashlib
import io
import os

import pytest
import torch

from zckpt_nb.examples import faults
from zckpt_nb.format.disk import PAGE
from zckpt_nb.format.writer import BLOCK, BLOCKS, DirectFile, Written, open_direct, write_hashed

pytestmark = pytest.mark.fast  # make test-fast

SIZES = [0, 1, PAGE - 1, PAGE, BLOCK, BLOCK + 1, 2 * BLOCK + PAGE + 3]


@pytest.mark.parametrize("size", SIZES)
def test_direct_file_writes_every_byte_and_hashes_them_whatever_the_size(size, tmp_path):
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    with DirectFile(path) as out:
        for i in range(0, size, 12345):  # torch.save writes in pieces of every size
            out.write(data[i:i + 12345])
    fd, direct = open_direct(tmp_path / "probe")  # does this filesystem take O_DIRECT? (tmpfs before 6.6 not)
    os.close(fd)
    assert out.direct == direct
    assert path.read_bytes() == data and out.hexdigest() == hashlib.sha256(data).hexdigest()
    assert out.fsync_seconds > 0


def test_a_closed_files_buffers_serve_the_next_file_and_never_two_open_files_at_once(tmp_path):
    big, small = os.urandom(2 * BLOCK + 5), os.urandom(PAGE + 7)
    with DirectFile(tmp_path / "big") as first:
        first.write(big)
        with DirectFile(tmp_path / "beside") as second:  # open while the first is: buffers of its own
            assert not {id(b) for b in second.buffers} & {id(b) for b in first.buffers}
            second.write(big)
            held = [id(b) for b in second.buffers]
    spare = [[id(b) for b in pair] for pair in BLOCKS.spare]
    assert spare == [held]  # the first file closed kept its buffers; the second's were unmapped (keep=1)
    with DirectFile(tmp_path / "small") as third:  # stale bytes sit in its buffers beyond `small`
        assert [id(b) for b in third.buffers] in spare  # taken from the kept pairs, not mapped anew
        third.write(small)
    assert (tmp_path / "small").read_bytes() == small and third.hexdigest() == hashlib.sha256(small).hexdigest()
    assert (tmp_path / "big").read_bytes() == big == (tmp_path / "beside").read_bytes()
    assert len(BLOCKS.spare) <= BLOCKS.keep and third.buffers == []
    with pytest.raises(IndexError):
        third.write(b"late")  # after close: fails here, not in another file's bytes


def test_torch_save_into_it_gives_torch_saves_own_bytes_without_crc_and_torch_load_reads_them(tmp_path):
    state = {"w": torch.randn(1_000_003), "step": torch.tensor(7)}
    memory = io.BytesIO()
    torch.serialization.set_crc32_options(False)  # as a durable save's Checkpointer sets it, once per process
    try:
        torch.save(state, memory)
        with DirectFile(tmp_path / "s.pt") as out:
            torch.save(state, out)
    finally:
        torch.serialization.set_crc32_options(True)
    assert (tmp_path / "s.pt").read_bytes() == memory.getvalue()
    for mmap in (False, True):  # what DeepSpeed's load_checkpoint and zero_to_fp32.py do
        loaded = torch.load(tmp_path / "s.pt", weights_only=True, mmap=mmap)
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7


def test_write_hashed_records_each_file_and_keeps_the_first_error_without_the_partial_file(tmp_path):
    def fail_halfway(state, out):
        out.write(b"x" * PAGE)
        raise OSError(errno.EIO, "I/O error")

    into = Written(rank=3)
    assert write_hashed(into, tmp_path / "a.pt", {"w": torch.ones(3)}, torch.save)
    assert into.written == [(tmp_path / "a.pt", hashlib.sha256((tmp_path / "a.pt").read_bytes()).hexdigest())]
    assert not write_hashed(into, tmp_path / "b.pt", None, fail_halfway)
    assert not (tmp_path / "b.pt").exists() and len(into.written) == 1
    first = into.error
    assert "rank 3" in first and "EIO" in first
    into.fail(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "c.pt")
    assert into.error == first


def test_a_full_disk_raises_enospc_and_closes_the_file(tmp_path):
    disk = tmp_path / "disk"
    with faults.tmpfs(disk, "size=2m") as why:
        if why:
            pytest.skip(why)
        open_fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError) as raised, DirectFile(disk / "big.bin") as out:
            for _ in range(4):
                out.write(os.urandom(BLOCK // 2))
        assert raised.value.errno == errno.ENOSPC
        assert len(os.listdir("/proc/self/fd")) == open_fds
        assert out.buffers == [] and len(BLOCKS.spare) <= BLOCKS.keep  # its buffers went back
