"""Planning at scale: exact counts for any causal-LM config, the time model, its calibration (a benchmark), the CLI."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from zckpt_nb import cli
from zckpt_nb.errors import UsageError
from zckpt_nb.model import config_file, meta_model, shipped_configs
from zckpt_nb.plan.costs import module_walk_numels, predict, tensor_numels
from zckpt_nb.plan.planning import PROTOCOL_OBJECT_COLLECTIVES, Bandwidths, collective_calls, plan, time_terms

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from calibration import (  # noqa: E402  (benchmarks/calibration.py: the time model fitted to measured saves)
    calibration,
    calibration_sentence,
    cpu_share,
    features,
    fit,
    machine_constants,
    measured_records,
    records_sentence,
)

pytestmark = pytest.mark.fast  # make test-fast


def llama_numel(c: dict) -> int:
    """Parameters of a Llama layout in closed form: embeddings, attention with grouped KV heads, gated MLP, norms."""
    h, v, layers, kv = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["num_key_value_heads"]
    head = h // c["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv * head + 3 * h * c["intermediate_size"] + 2 * h
    return v * h * (1 if c["tie_word_embeddings"] else 2) + layers * layer + h


def gpt2_numel(c: dict) -> int:
    """Parameters of a GPT-2 layout in closed form (lm_head tied to wte)."""
    h, inner = c["n_embd"], c.get("n_inner") or 4 * c["n_embd"]
    layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    return (c["vocab_size"] + c["n_positions"]) * h + c["n_layer"] * layer + 2 * h


@pytest.mark.parametrize("name", shipped_configs())
def test_shipped_configs_count_exactly(name):
    config = json.loads(config_file(name).read_text())
    closed_form = llama_numel(config) if config["model_type"] == "llama" else gpt2_numel(config)
    assert sum(tensor_numels(name)) == meta_model(name).num_parameters() == closed_form
    assert all(p.device.type == "meta" for p in meta_model(name).parameters())


def random_configs(seed: int) -> list[dict]:
    """Small GPT-2, Llama, Mistral and Qwen2 configs, tied and untied, with random shapes."""
    rng = random.Random(seed)
    out = []
    for kind in ("gpt2", "llama", "mistral", "qwen2"):
        for tied in (True, False):
            heads = rng.choice([2, 4])
            hidden = heads * rng.choice([8, 16])
            if kind == "gpt2":
                out.append({"model_type": "gpt2", "n_embd": hidden, "n_head": heads, "n_layer": rng.randint(1, 3),
                            "vocab_size": rng.randint(50, 300), "n_positions": rng.choice([16, 32]),
                            "tie_word_embeddings": tied})
            else:
                out.append({"model_type": kind, "hidden_size": hidden, "num_attention_heads": heads,
                            "num_key_value_heads": rng.choice([1, heads]), "num_hidden_layers": rng.randint(1, 3),
                            "intermediate_size": rng.randint(20, 90), "vocab_size": rng.randint(50, 300),
                            "tie_word_embeddings": tied})
    return out


@pytest.mark.parametrize("config", random_configs(14), ids=lambda c: f"{c['model_type']}-{c['tie_word_embeddings']}")
def test_random_small_configs_count_what_transformers_builds(config, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    kind = config["model_type"]
    real = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{k: v for k, v in config.items()
                                                                          if k != "model_type"}))
    assert sum(tensor_numels(str(tmp_path))) == real.num_parameters()  # the folder, built on meta
    walk, distinct = sum(module_walk_numels(str(path))), sum(tensor_numels(str(path)))
    lm_head = real.get_output_embeddings().weight.numel()
    # a tied lm_head is one tensor (counted once) that save_16bit_model's module walk meets twice
    assert walk - distinct == (lm_head if real.config.tie_word_embeddings else 0)
    assert torch.equal(torch.tensor(sum(p.numel() for p in real.parameters())), torch.tensor(distinct))


def test_a_70b_model_plans_in_little_memory():
    """A 70 B model is planned on meta tensors: nothing of its size is built (its seconds are a benchmark's concern)."""
    code = ("import resource; from zckpt_nb.plan.costs import predict; p = predict('llama-3-70b', 4096, 'bf16'); "
            "print(p.num_params, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    params, rss_kib = done.stdout.split()
    assert int(params) == 70_553_706_496
    assert int(rss_kib) < 1.5 * 2**20, rss_kib  # imports included; < 1.5 GiB


def test_time_terms_follow_the_bytes():
    bw = Bandwidths(write_gbps=2, read_gbps=4, net_gbps=10)
    pred = predict("llama-3-8b", 64, "bf16")
    terms = time_terms(pred, bw)
    assert terms["partitioned"]["write"] == pred.saves["partitioned"].written_bytes / 2e9
    assert terms["per_param"]["net"] == 63 * pred.saves["per_param"].ops["all_gather_into_tensor"] / 10e9
    assert terms["offline"] == {"read": 4 * 64 * pred.slice_numel / 4e9,  # the fp32 master slices only
                                "write": 4 * pred.num_params / 2e9}
    rows = {r.route: r for r in plan("llama-3-8b", 64, bw)}
    assert rows["offline"].stall_s == rows["partitioned"].stall_s < rows["offline"].durable_s
    assert rows["partitioned"].resumable and not rows["gathered16"].resumable
    assert "gathered16" not in {r.route for r in plan("llama-3-8b", 64, bw, gather_16bit=False)}


def test_the_cheapest_route_follows_the_numbers_given():
    bw = Bandwidths(write_gbps=2, read_gbps=2, net_gbps=25)
    # one rank: the partitioned save writes 12 B per parameter, a 16-bit save 2 B: the 16-bit saves stall less
    one = min(plan("llama-3-8b", 1, bw), key=lambda r: r.stall_s)
    many = min(plan("llama-3-8b", 512, bw), key=lambda r: r.stall_s)
    assert one.route in ("gathered16", "per_param") and many.route in ("partitioned", "offline")


def test_a_filesystem_cap_shares_out_among_the_ranks_that_write_at_once():
    bw = Bandwidths(write_gbps=0.25, read_gbps=0.25, net_gbps=25)
    free = {r.route: r for r in plan("llama-3-8b", 64, bw)}
    rows = {r.route: r for r in plan("llama-3-8b", 64, bw, fs_cap_gbps=10)}  # 64 x 0.25 = 16 GB/s > 10
    assert rows["partitioned"].seconds["write"] == pytest.approx(free["partitioned"].seconds["write"] * 16 / 10)
    assert all(rows[m].seconds == free[m].seconds for m in ("gathered16", "per_param"))  # rank 0 alone: not capped
    loose = {r.route: r for r in plan("llama-3-8b", 64, bw, fs_cap_gbps=100)}
    assert all(loose[m].seconds == free[m].seconds for m in free)  # a cap above 16 GB/s does not bind
    with pytest.raises(UsageError, match="cap must be a positive"):
        plan("llama-3-8b", 64, bw, fs_cap_gbps=0)


def test_a_step_latency_adds_ring_steps_per_collective_call():
    pred = predict("llama-3-8b", 64, "bf16")
    calls = len(tensor_numels("llama-3-8b"))  # one all-gather per distinct tensor
    terms = time_terms(pred, Bandwidths(2, 2, 25, step_latency_us=5))["per_param"]
    assert terms["steps"] == pytest.approx(calls * 63 * 5e-6)
    assert "steps" not in time_terms(pred, Bandwidths(2, 2, 25))["per_param"]
    with pytest.raises(UsageError, match="step latency and the cost per file at least 0"):
        Bandwidths(2, 2, 25, step_latency_us=-1)


def test_a_cost_per_file_adds_two_rank_files_per_rank_to_the_conversion_only(capsys):
    rows = {r.route: r for r in plan("llama-3-8b", 512, Bandwidths(2, 2, 25, file_ms=3), "bf16")}
    plain = {r.route: r for r in plan("llama-3-8b", 512, Bandwidths(2, 2, 25), "bf16")}
    assert rows["offline"].seconds["files"] == pytest.approx(1024 * 3e-3)
    assert rows["offline"].durable_s - plain["offline"].durable_s == pytest.approx(1024 * 3e-3)
    assert all(rows[m].seconds == plain[m].seconds for m in ("partitioned", "gathered16", "per_param"))
    code, out, _ = run_costs(capsys, "--config", "llama-3-8b", "--nproc", "512", "--file_ms", "3", "--json")
    assert code == 0 and json.loads(out)["plan"][-1]["seconds"]["files"] == pytest.approx(3.072)
    with pytest.raises(UsageError, match="cost per file at least 0"):
        Bandwidths(2, 2, 25, file_ms=-1)


def test_predicted_collective_calls_are_the_calls_deepspeed_logged():
    records = [r for r in measured_records() if r["world_size"] > 1]  # one rank makes no ring step
    assert {r["mode"] for r in records} >= {"partitioned", "gathered16", "per_param"}
    for r in records:  # the comms logger misses the commit protocol's object collectives: a size and a payload each
        pred = predict(r["model"], r["world_size"], r["dtype"], r["persistence_threshold"])
        logged = sum(r["logged_comm_ops"].values()) + 2 * r["protocol_comm_ops"]
        assert collective_calls(pred, r["mode"]) == logged, r
    assert {r["protocol_comm_ops"] for r in records if r["mode"] == "partitioned"} == {
        PROTOCOL_OBJECT_COLLECTIVES}


KNOWN = {"fixed partitioned": 0.02, "fixed gathered16": 0.01, "fixed per_param": 0.01, "fixed offline": 0.15,
         "fixed hf": 0.03, "bytes partitioned": 1 / 0.5e9, "bytes gathered16": 1 / 0.7e9, "bytes per_param": 1 / 0.5e9,
         "bytes offline": 1 / 2e9, "bytes hf": 1 / 1.3e9, "files offline": 1e-3, "files hf": 3e-3,
         "net": 1 / 1.2e9}  # seconds per save, per byte, per rank file read


def synthetic_records(constants: dict[str, float], cpus: int) -> list[dict]:
    """Records whose seconds follow the fitted form exactly: known constants times each save's features."""
    out = []
    for model, sizes in (("tiny", (1, 2, 3, 4)), ("small", (1, 2, 3))):
        for n in sizes:
            for mode in ("partitioned", "gathered16", "per_param", "offline", "hf"):
                r = {"model": model, "mode": mode, "world_size": n, "rank": 0, "dtype": "fp32", "cpus": cpus,
                     "persistence_threshold": 0, "predicted_bytes": 1, "measured_payload_bytes": 1}
                r["seconds"] = sum(v * constants.get(k, 0) for k, v in features(r).items())
                out.append(r)
    return out


def test_calibration_recovers_known_constants_leaving_each_save_out():
    known = {**KNOWN, "steps": 5e-4}
    records = synthetic_records(known, cpus=2)
    rows = calibration(records, Bandwidths(1, 1, 1))
    assert len(rows) == 35
    for r in rows:
        assert abs(r["fitted error"]) < 1e-6, r
    assert fit(rows) == pytest.approx(known, rel=1e-6)
    # four ranks on two cores take turns: the same save's CPU work takes twice as long
    part4 = next(r for r in records if r["mode"] == "partitioned" and r["world_size"] == 4)
    assert cpu_share(part4) == 2 and cpu_share({**part4, "mode": "offline"}) == 1
    sentence = calibration_sentence(rows)
    assert "fitted on its other saves, 35 of 35 within 25%" in sentence
    elsewhere = [{**r, "machine": "a laptop"} for r in records[:5]]  # too few saves there to fit 14 constants
    rows = calibration(records + elsewhere, Bandwidths(1, 1, 1))
    assert [r["fitted s"] for r in rows[-5:]] == [None] * 5
    sentence = calibration_sentence(rows)
    assert "other saves, 35 of 35 within 25%" in sentence and "Against 40 measured saves" in sentence
    assert "(5 saves of a machine with too few of them to fit have no fitted figure)" in sentence


def test_a_term_that_would_fit_below_zero_is_dropped():
    records = synthetic_records(KNOWN, cpus=2)
    for r in records:  # saves with more ring steps measured faster: a negative latency would fit best
        r["seconds"] -= 1e-4 * features(r)["steps"] * 0.1
    constants = fit(calibration(records, Bandwidths(1, 1, 1)))
    assert constants["steps"] == 0 and all(v >= 0 for v in constants.values())


def test_calibration_on_the_shipped_measurements():
    """Exact bytes; seconds: the fitted constants predict 9 in 10 saves within 25%, far more than bandwidths alone.

    Not every one: on this machine single repeats of one save spread by up to 2.7x (the sentence gives that floor),
    and issue 14's goal of every save within 25% is not met (46 of 50); this guards what is.
    """
    rows = calibration(measured_records(), Bandwidths(0.5, 0.8, 0.5))
    assert rows and all(r["bytes exact"] for r in rows)
    assert {r["mode"] for r in rows} == {"partitioned", "gathered16", "per_param", "offline", "hf"}
    assert {(r["model"], r["N"]) for r in rows} >= {("tiny", 4), ("small", 3), ("medium", 3)}
    fitted = sum(abs(r["fitted error"]) <= 0.25 for r in rows)
    alone = sum(abs(r["bandwidth-only error"]) <= 0.25 for r in rows)
    assert fitted >= 0.9 * len(rows) and fitted > 2 * alone
    assert [c["constant"] for c in machine_constants(rows)][-1] == "time of one ring step"
    assert "single repeats lie within 25% of their median" in calibration_sentence(rows)


def test_records_sentence_reads_coverage_and_repeats_from_the_records():
    shipped = measured_records()
    repeats = {len(r["repeat_seconds"]) for r in shipped}
    laptop = [{"model": "tiny", "mode": m, "world_size": 2, "rank": 0, "machine": "a laptop"}
              for m in ("hf", "offline")]
    sentence = records_sentence(shipped + laptop)
    assert repeats == {7} and "`medium` at N = 1, 2, 3; 5 save modes, 86 records (every rank), each the median " \
        "of 7 repeats" in sentence
    assert sentence.endswith("a laptop: `tiny` at N = 2; 2 save modes, 2 records (every rank), each measured once.")


def run_costs(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["costs", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_costs_cli_plans_a_shipped_config(capsys):
    code, out, _ = run_costs(capsys, "--config", "llama-3-8b", "--nproc", "8",
                             "--dtype", "bf16", "--write_gbps", "1", "--json")
    data = json.loads(out)
    assert code == 0 and data["prediction"]["world_size"] == 8 and data["prediction"]["num_params"] == 8_030_261_248
    assert [r["route"] for r in data["plan"]] == ["partitioned", "gathered16", "per_param", "offline"]
    assert data["plan"][0]["written_bytes"] == data["prediction"]["saves"]["partitioned"]["written_bytes"]


def test_costs_cli_takes_a_config_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(config_file("gpt2-xl").read_text())
    code, out, _ = run_costs(capsys, "--config", str(tmp_path), "--nproc", "8", "4096", "--gather_16bit", "off")
    table_routes = {line.split()[1] for line in out.splitlines() if line.split()[:1] in (["8"], ["4,096"])}
    assert code == 0 and "P = 1,557,611,200" in out and table_routes == {"partitioned", "per_param", "offline"}
    assert out.count("least stall") == 2


@pytest.mark.parametrize("case, expected", [
    ("missing", "no config.json at"),
    ("vision", "is not the config of a causal LM transformers ships (model_type 'vit')"),
    ("not json", "is not JSON"),
    ("no rank", "world sizes must be at least 1"),
    ("zero bandwidth", "bandwidths must be positive"),
])
def test_costs_cli_refuses_bad_input_in_one_line(case, expected, tmp_path, capsys):
    (tmp_path / "vit.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 64}))
    (tmp_path / "bad.json").write_text("{not json")
    argv = {"missing": ["--config", str(tmp_path / "nope.json")], "vision": ["--config", str(tmp_path / "vit.json")],
            "not json": ["--config", str(tmp_path / "bad.json")], "no rank": ["--nproc", "0"],
            "zero bandwidth": ["--config", "gpt2-xl", "--net_gbps", "0"]}[case]
    code, out, err = run_costs(capsys, *argv)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and expected in err, err
