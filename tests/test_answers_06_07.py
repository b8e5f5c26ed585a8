"""Notebook 07: exercise answers speak of the parameter the learner changed, against the default's figure, and the
tables say each figure once (unit tests on hand-made records, no launch)."""

import pytest

from zckpt_nb.format.manifest import FileEntry, Manifest
from zckpt_nb.lessons import worlds
from zckpt_nb.lessons.claims import RESUME_TOLERANCE


@pytest.mark.fast
def test_the_batch_answer_compares_with_the_presets_batch_and_the_dtypes_tolerance():
    rows = [{"resumed on N": 3, "accumulation steps": 1, "max |loss difference|": 0.012, "steps compared": 5}]
    said = worlds.batch_answer(rows, 7, 16, 8, "bf16")
    assert said.startswith("This run used a global batch of 7 (the preset's is 16)")
    assert "on 3 ranks: 2 to 3 sequences per rank in 1 micro-step (with 16: 5 to 6" in said
    assert f"within bf16's {RESUME_TOLERANCE['bf16']:.0e}" in said
    assert f"above fp32's {RESUME_TOLERANCE['fp32']:.0e}" in worlds.batch_answer(rows, 7, 16, 8, "fp32")
    at_default = worlds.batch_answer(rows, 16, 16, 8, "fp32")
    assert "set `GLOBAL_BATCH = 7`" in at_default
    assert "(with 7: 2 to 3 sequences per rank in 1 micro-step)" in at_default
    with_source = worlds.batch_answer(rows, 16, 16, 8, "fp32", source_n=2)
    assert with_source.count("on 2 ranks (the saving run): 8 sequences") == 1


@pytest.mark.fast
def test_the_resume_table_shows_a_conversion_only_where_the_job_made_it():
    row = {"resumed on N": 1, "loaded from": "a universal copy it was given", "conversion (s)": 3.9,
           "conversion peak RSS (MiB)": 257, "max |loss difference|": 2.38419e-07}
    assert worlds.resume_table([row]) == [{"resumed on N": 1, "loaded from": "a universal copy it was given",
                                           "max |loss difference| (nats per token)": "2.4e-07"}]
    made = row | {"loaded from": "a universal copy it made"}
    assert "conversion (s)" in worlds.resume_table([row, made])[0]


@pytest.mark.fast
def test_the_universal_sentence_finds_rank_0s_optimizer_file_in_bf16_too():
    def files(*pairs):
        return [FileEntry(path, size, "0" * 64) for path, size in pairs]

    copy = Manifest("global_step2", 2, files(
        ("zero/w/fp32.pt", 100), ("zero/w/exp_avg.pt", 100), ("zero/w/exp_avg_sq.pt", 100),
        ("zero/optimizer_state.pt", 250), ("bf16_zero_pp_rank_0_mp_rank_00_model_states.pt", 50)),
        kind="universal", conversion={"bytes": 600, "source_bytes": 400})
    source = Manifest("global_step2", 2, files(("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", 250),
                                               ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", 100)), world_size=2)
    said = worlds.universal_sentence(copy, source, elements=10, folders=1, num_params=10)
    assert "exactly P" in said and "1.50x the source's" in said and "300 in the per-parameter files" in said
    assert "250 in `zero/optimizer_state.pt`, 1.00x rank 0's optimizer file" in said and "and 50 in the" in said


@pytest.mark.fast
def test_the_nodes_answer_sets_three_nodes_against_the_defaults_folders():
    rows = [{"folder": f"node{k}", "ranks whose files it holds": str(k), "files its manifest lists": 6,
             "of them on other nodes": 4} for k in range(3)]
    said = worlds.nodes_answer(rows, default_nodes=2)
    assert "This run simulated 3 nodes (the default is 2)" in said
    assert "With the default 2 nodes: 2 folders, each manifest listing 4 files, 2 of them on other nodes" in said
    at_default = worlds.nodes_answer(rows[:2], default_nodes=2)
    assert "With the default" not in at_default and "With 3 nodes: 3 folders, each manifest listing 9 files, 6 of" \
        in at_default
    assert [worlds.sequences_per_rank(16, n) for n in (1, 2, 3)] == ["16", "8", "5 to 6"]


@pytest.mark.fast
def test_the_resumption_sentence_says_where_the_conversion_is_needed():
    copy = Manifest("global_step2", 2, [], kind="universal", source_world_size=2,
                    conversion={"seconds": 2.06, "bytes": 3 * 2**20, "source_bytes": 2 * 2**20})
    said = worlds.resumption_sentence(copy, 1, refused=True)
    assert "holds on the 2 ranks that saved it only" in said and "refused it on 1 rank (section 3)" in said
    assert "must first be converted into the universal copy" in said
    assert "refused" not in worlds.resumption_sentence(copy, 3, refused=False)
