"""`snapshot.host_copy`: the asynchronous save's frozen copy serialises to the file DeepSpeed would have written."""

import io

import pytest
import torch

from zckpt_nb.saving import snapshot

pytestmark = pytest.mark.fast  # make test-fast


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def state():
    flat = torch.arange(10, dtype=torch.float32)
    return {"flat": [flat], "views": (flat[2:5], flat[5:]), "param": torch.nn.Parameter(torch.ones(3)),
            "step": torch.tensor(7), "shapes": {"w": torch.Size([2, 5])}, "name": "rank0"}


def test_copy_writes_the_same_file_and_keeps_storage_sharing():
    original = state()
    copied = snapshot.host_copy(original)
    assert saved(copied) == saved(original)
    assert copied["views"][0].untyped_storage().data_ptr() == copied["flat"][0].untyped_storage().data_ptr()
    assert isinstance(copied["param"], torch.nn.Parameter) and copied["param"].requires_grad
    assert snapshot.storage_bytes(copied) == 10 * 4 + 3 * 4 + 8


def test_copy_is_frozen_when_training_changes_the_tensors():
    original = state()
    copied = snapshot.host_copy(original)
    before = saved(copied)
    original["flat"][0].mul_(3)
    original["param"].data.zero_()
    assert saved(copied) == before != saved(original)


def test_device_path_copies_each_storage_once_and_keeps_views():
    """`to_host` is what a GPU tensor goes through; run here on CPU tensors, it must give the same views."""
    flat = torch.arange(12, dtype=torch.float64)
    storages: dict = {}
    staging = snapshot.Staging()
    a, b = snapshot.to_host(flat[1:4], storages, staging), snapshot.to_host(flat.view(3, 4)[:, 1], storages, staging)
    assert len(storages) == 1 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert torch.equal(a, flat[1:4]) and torch.equal(b, flat.view(3, 4)[:, 1]) and b.stride() == (4,)
    param = snapshot.to_host(torch.nn.Parameter(torch.ones(2)), storages, staging)
    assert isinstance(param, torch.nn.Parameter)


def test_staging_reuses_each_buffer_at_the_next_save_and_drops_the_unused():
    """A saver's next save copies into the same host buffers; a storage it no longer saves loses its buffer."""
    kept, gone = torch.arange(6, dtype=torch.float32), torch.ones(3)
    staging = snapshot.Staging()
    staging.next_save()
    first = snapshot.host_copy({"kept": kept, "gone": gone}, staging)
    kept.add_(1)
    staging.next_save()
    second = snapshot.host_copy({"kept": kept}, staging)
    assert second["kept"].untyped_storage().data_ptr() == first["kept"].untyped_storage().data_ptr()
    assert torch.equal(second["kept"], kept) and len(staging.used) == 1
    staging.next_save()
    assert len(staging.kept) == 1  # the buffer of the storage the second save left out is freed
