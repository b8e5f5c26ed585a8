"""World size by device count (run.devices): the ranks a launch gets on 1, 2, 4 and 8 GPUs and on CPU."""

import os

import pytest

from zckpt_nb.course.ranks import choose_world, lesson_dtype, lesson_placement, use_lesson_ranks
from zckpt_nb.errors import UsageError
from zckpt_nb.run.launch import check_train_args, worker_env
from zckpt_nb.run.options import TrainOptions

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("requested", [1, 2, 3, 4, 8])
def test_gpu_ranks_never_exceed_the_gpus(gpus, requested):
    fit = choose_world(requested, "cuda", gpus)
    assert fit.accelerator == "cuda" and fit.ranks == min(requested, gpus)
    exact = choose_world(requested, "cuda", gpus, exact=True)
    assert exact.ranks == requested
    assert exact.accelerator == ("cuda" if requested <= gpus else "cpu")
    if requested > gpus:
        assert "DS_ACCELERATOR=cpu" in fit.note and "one GPU per rank" in fit.note
        assert worker_env(requested, exact)["DS_ACCELERATOR"] == "cpu"


@pytest.mark.parametrize("accelerator, gpus", [("cpu", 0), ("cpu", 8), ("cuda", 0)])
def test_cpu_ranks_any_number(accelerator, gpus):
    choice = choose_world(5, accelerator, gpus)
    assert (choice.ranks, choice.accelerator) == (5, "cpu")
    assert "CPU rank" in choice.note and "DS_ACCELERATOR=cpu" in choice.note


def test_refusal_names_cpu_ranks(monkeypatch, tmp_path):
    monkeypatch.setattr("zckpt_nb.run.launch.gpu_count", lambda: 2)  # pretend: this machine has two GPUs
    with pytest.raises(UsageError, match="DS_ACCELERATOR=cpu"):
        check_train_args(4, TrainOptions(output_dir=str(tmp_path), steps=10))
    cpu = choose_world(4, "cuda", 2, exact=True)
    check_train_args(4, TrainOptions(output_dir=str(tmp_path), steps=10), placement=cpu)  # CPU ranks: accepted
    assert worker_env(4, cpu)["DS_ACCELERATOR"] == "cpu"


@pytest.mark.parametrize("gpus", [0, 1, 2, 4, 8])
def test_a_notebook_runs_all_its_launches_on_one_kind_of_rank(gpus):
    accelerator = "cuda" if gpus else "cpu"
    where = lesson_placement([1, 3], accelerator, gpus)
    assert where.accelerator == ("cuda" if gpus >= 3 else "cpu")  # the 1-rank job too: figures compared like with like
    assert lesson_placement([2], accelerator, gpus).accelerator == ("cuda" if gpus >= 2 else "cpu")


def test_the_notebook_choice_sets_cpu_ranks_for_the_kernel(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr("zckpt_nb.course.ranks.machine", lambda: ("cuda", 1))  # pretend: a 1-GPU laptop
    assert use_lesson_ranks([1, 2]) == "cpu"
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr("zckpt_nb.course.ranks.machine", lambda: ("cuda", 8))
    assert use_lesson_ranks([1, 2]) == "cuda" and "DS_ACCELERATOR" not in os.environ


def test_auto_dtype_follows_the_ranks(monkeypatch):
    monkeypatch.setattr("zckpt_nb.course.ranks.machine", lambda: ("cuda", 2))
    assert (lesson_dtype("auto"), lesson_dtype("fp32")) == ("bf16", "fp32")
    monkeypatch.setattr("zckpt_nb.course.ranks.machine", lambda: ("cpu", 0))
    assert (lesson_dtype("auto"), lesson_dtype("bf16")) == ("fp32", "bf16")


def test_cpu_only_lessons_run_cpu_ranks_whatever_the_gpus(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr("zckpt_nb.course.ranks.machine", lambda: ("cuda", 8))  # the ranks would fit: CPU all the same
    assert use_lesson_ranks([3, 2, 3], cpu_only=True) == "cpu"
    assert os.environ["DS_ACCELERATOR"] == "cpu"
