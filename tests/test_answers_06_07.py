"""Notebooks 06 and 07: exercise answers speak of the parameter the learner changed, against the default's figure,
and the summary and tables say each figure once (unit tests on hand-made records, no launch)."""

import pytest

from zckpt_nb.lessons import save_modes, stall, worlds
from zckpt_nb.lessons.claims import RESUME_TOLERANCE
from zckpt_nb.lessons.compare import predicted_for
from zckpt_nb.plan.costs import predict


def record(mode, n, rank, logged, ops=None):
    return {"model": "tiny", "dtype": "fp32", "persistence_threshold": 0, "mode": mode, "world_size": n,
            "rank": rank, "logged_comm_bytes": logged, "logged_comm_ops": ops or {}}


# not fast: the cost model builds the preset on the meta device (imports transformers)
def test_the_world_size_answer_sets_the_run_against_the_default_and_the_default_against_three():
    at_3 = [record("gathered16", 3, 0, 4096), record("partitioned", 3, 0, 40, {"barrier": 2})]
    said = save_modes.world_answer(at_3, default_n=2)
    two = predicted_for(predict("tiny", 2), "gathered16", 0)["predicted_comm_bytes"]
    assert said.startswith("This run measured N = 3 (the default is 2)")
    assert f"gathered16 4.0 KiB (the cost model: {two / 1024:,.1f} KiB at N = 2)" in said
    assert "Most: gathered16" in said and "The partitioned save moved 40 B, about 1/102 of gathered16's" in said
    persistent = [record("partitioned", 3, 0, 2000, {"all_gather_into_tensor": 2}), record("per_param", 3, 0, 1000)]
    assert "moved 2,000 B, 2.00x per_param's: not negligible" in save_modes.world_answer(persistent, default_n=2)
    at_2 = [record("gathered16", 2, 0, 4096)]
    assert "at N = 3)" in save_modes.world_answer(at_2, default_n=2) and "(the default)" in save_modes.world_answer(
        at_2, default_n=2)


def save(tag, stall_s, durable=None, wait=0.0):
    return {"tag": tag, "committed": True, "stall_seconds": stall_s, "durable_seconds": durable,
            "commit_wait_seconds": wait}


@pytest.mark.fast
def test_the_decoupled_answer_calls_a_difference_within_chance_a_tie():
    plain = [stall.save_record("plain", 0, save(t, s)) for t, s in (("a", 0.03), ("b", 0.02), ("c", 0.04))]
    close = [stall.save_record("ds_decoupled", 0, save(t, s)) for t, s in (("a", 0.031), ("b", 0.021), ("c", 0.04))]
    assert "a tie with plain" in stall.decoupled_sentence(plain + close)
    far = [stall.save_record("ds_decoupled", 0, save(t, 0.03, wait=0.7)) for t in "abc"]
    assert "more than plain, beyond chance" in stall.decoupled_sentence(plain + far)


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
def test_the_summary_of_06_has_one_row_per_finding_and_no_interval_without_a_durable_mode():
    rows = [{"collective bytes: predicted = logged": True, "worst payload error (%)": 0.0}]
    records = [{"predicted_extra_peak_bytes": 100, "measured_extra_peak_bytes": 110}]
    stalls = stall.summary([stall.save_record("plain", 0, save("a", 0.02))])
    memory = [{"snapshot MiB": 0.0}]
    table = save_modes.summary_rows(rows, records, stalls, [], memory, [])
    assert [r["section"] for r in table] == ["1", "1", "2", "2", "3", "4", "5"]
    assert table[1]["this run"].startswith("1 of 1 predicted peaks within 25%")
    assert table[3]["this run"] == f"plain {stall.NEVER}"
    assert table[4]["this run"] == "not measured" and table[6]["this run"] == "no durable mode ran"


@pytest.mark.fast
def test_a_sampled_peak_below_its_prediction_is_a_lower_bound_and_one_above_is_a_miss():
    def rec(predicted, measured):
        return {"mode": "gathered16", "world_size": 2, "rank": 1, "predicted_extra_peak_bytes": predicted,
                "measured_extra_peak_bytes": measured, "measured_memory_kind": "host heap"}

    below = save_modes.memory_agreement([rec(100, 100), rec(100, 50)])
    assert "1 of 2 predicted extra peaks lie within 25%" in below and "Nothing here refutes" in below
    assert "Below it: gathered16 at N = 2, rank 1, measured" in below and "lower bound" in below
    above = save_modes.memory_agreement([rec(100, 100), rec(100, 150)])
    assert "Above it: gathered16" in above and "a miss of the model" in above and "Below it" not in above
    assert "gathered16 rank 1 above it (a miss)" in save_modes.memory_summary([rec(100, 100), rec(100, 150)])
    unseen = save_modes.memory_agreement([rec(100, 100), rec(0, 2**20) | {"mode": "hf", "rank": 0}])
    assert "no extra memory for 1 more save that measured some" in unseen and "hf at N = 2, rank 0, 1.000 MiB" \
        in unseen and "refutes" not in unseen


@pytest.mark.fast
def test_the_universal_sentence_finds_rank_0s_optimizer_file_in_bf16_too():
    copy = {"conversion": {"bytes": 600, "source_bytes": 400},
            "files": [{"path": "zero/w/fp32.pt", "bytes": 100}, {"path": "zero/w/exp_avg.pt", "bytes": 100},
                      {"path": "zero/w/exp_avg_sq.pt", "bytes": 100}, {"path": "zero/optimizer_state.pt", "bytes": 250},
                      {"path": "bf16_zero_pp_rank_0_mp_rank_00_model_states.pt", "bytes": 50}]}
    source = {"files": [{"path": "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bytes": 250},
                        {"path": "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "bytes": 100}]}
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
    copy = {"source_world_size": 2, "conversion": {"seconds": 2.06, "bytes": 3 * 2**20, "source_bytes": 2 * 2**20}}
    said = worlds.resumption_sentence(copy, 1, refused=True)
    assert "holds on the 2 ranks that saved it only" in said and "refused it on 1 rank (section 3)" in said
    assert "must first be converted into the universal copy" in said
    assert "refused" not in worlds.resumption_sentence(copy, 3, refused=False)
