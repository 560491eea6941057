"""megamoe-train-bench's rows and record: a real trainer summary made into a row, rows
merged across invocations, the comparisons against mega_moe, the table and the plot."""

import json

import pytest

from megamoe.train import bench
from megamoe.train.trainer import main as train_main


def _row(backend, losses, step_ms, repeat=1, precision="bf16", seed=None):
    extra = {} if seed is None else {"seed": seed}
    return {"backend": backend, "precision": precision, "repeat": repeat, "status": "ok", **extra,
            "steps_run": len(losses), "step_ms": step_ms, "tokens_per_s_per_gpu": 1e3 / step_ms,
            "mfu": None, "peak_memory_gib": None, "optimizer_ms": 1.0, "loss": losses,
            "step_time_s": [step_ms / 1e3] * len(losses), "parts": None,
            "summary": {"gpu": "test-gpu", "commit": "abc", "config": {"train": {}}}}


def test_real_summary_becomes_a_row(tmp_path):
    summary_path = tmp_path / "summary.json"
    assert train_main(["default-cpu", "--train.steps", "6", "--data.seq_len", "64",
                       "--log.dir", str(tmp_path / "log"),
                       "--log.plot", "false", "--time-parts", "--summary-json",
                       str(summary_path)]) == 0
    row = bench.row_from_summary(json.loads(summary_path.read_text()))
    assert row["status"] == "ok" and row["steps_run"] == 6 and len(row["loss"]) == 6
    assert row["step_ms"] > 0 and row["optimizer_ms"] > 0
    for part in ("attention", "router", "experts", "lm_head_loss"):
        assert 0 < row["parts"][part]["fwd_ms"] < row["parts"][part]["fwd_bwd_ms"] * 2
    # The attention kernel alone (what a recompute skips when its outputs are kept).
    attention = row["parts"]["attention"]
    assert 0 < attention["kernel_fwd_ms"] < attention["fwd_ms"]
    breakdown = row["breakdown"]
    assert set(breakdown) == {"attention_ms", "router_ms", "experts_ms", "lm_head_loss_ms",
                              "optimizer_ms", "other_ms"}
    assert sum(breakdown.values()) == pytest.approx(row["step_ms"])
    # The checkpointed forward that the breakdown adds per layer leaves the kernel out.
    parts = row["parts"]
    full = bench.step_breakdown(parts, 2, 100.0, 1.0, True, 1, saves_attention=False)
    kept = bench.step_breakdown(parts, 2, 100.0, 1.0, True, 1, saves_attention=True)
    assert full["attention_ms"] - kept["attention_ms"] == pytest.approx(
        2 * attention["kernel_fwd_ms"])


def test_merge_compares_with_mega_moe(tmp_path):
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    base = [3.0 - 0.001 * i for i in range(300)]
    rows = {"mega_moe-bf16": _row("mega_moe", base, 100.0),
            "mega_moe-bf16-run2": _row("mega_moe", base[:50] + [9.0] * 250, 101.0, repeat=2),
            "torch-bf16": _row("torch", [v * 1.005 for v in base], 120.0),
            "hf-bf16": _row("hf", base[:100], 130.0),  # too short for the parity window
            "mega_moe-fp8": _row("mega_moe", [v * 1.01 for v in base], 80.0, precision="fp8")}
    for key, row in rows.items():  # written as separate invocations would
        (rows_dir / f"{key}.json").write_text(json.dumps(row))
    record = bench.merge(rows_dir, "test", (200, 300), "megamoe-train-bench --merge")
    assert [r["backend"] for r in record["rows"]] == ["mega_moe", "mega_moe", "mega_moe",
                                                      "torch", "hf"]
    assert record["gpu"] == "test-gpu" and record["commit"] == "abc"
    torch_cmp = record["comparison"]["torch-bf16"]
    assert torch_cmp["mega_moe_speedup"] == pytest.approx(1.2)
    assert torch_cmp["loss_rel_diff_vs_mega_moe"] == pytest.approx(0.005)
    assert "needs both runs to reach step 300" in record["comparison"]["hf-bf16"]["loss_parity"]
    repeat = record["comparison"]["mega_moe-bf16-run2"]
    assert repeat["bitwise_identical_steps"] == 50 and repeat["bitwise_identical"] is False
    fp8 = record["comparison"]["mega_moe-fp8"]
    assert fp8["speedup_vs_torch_bf16"] == pytest.approx(1.5)
    assert fp8["loss_rel_diff_vs_mega_moe_bf16"] == pytest.approx(0.01)
    # Means over the runs that reach the window (mega_moe run 2 reaches it too).
    parity = record["parity_over_runs"]
    assert parity["mega_moe-bf16"]["runs"] == 2 and "hf-bf16" not in parity
    mega_mean = parity["mega_moe-bf16"]["mean"]
    assert parity["mega_moe-bf16"]["max"] == pytest.approx(9.0)
    assert parity["torch-bf16"]["rel_diff_vs_mega_moe"] == pytest.approx(
        parity["torch-bf16"]["mean"] / mega_mean - 1)
    table = bench.format_table(record)
    assert "torch-bf16: mean loss" in table and "over 1 run(s)" in table
    assert "mega_moe-fp8: 1.500x the torch bf16 step, loss +1.00% of mega_moe bf16's" in table
    assert "torch" in table and "+0.50" in table and "NOT identical" in table
    assert bench.plot(record, tmp_path / "test.png").stat().st_size > 0


def test_seeds_are_compared_seed_by_seed(tmp_path):
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    curve = [3.0 - 0.001 * i for i in range(300)]
    # mega_moe's seeds lie 2% apart; torch is 0.5% below mega_moe at seed 0, 1% above at 1.
    rows = [_row("mega_moe", curve, 100.0, seed=0),
            _row("mega_moe", [v * 1.02 for v in curve], 100.0, seed=1),
            _row("torch", [v * 0.995 for v in curve], 125.0, seed=0),
            _row("torch", [v * 1.02 * 1.01 for v in curve], 110.0, seed=1),
            _row("mega_moe", [v * 1.03 for v in curve], 80.0, precision="fp8", seed=1)]
    for row in rows:
        (rows_dir / f"{bench._row_key(row)}.json").write_text(json.dumps(row))
    assert sorted(p.stem for p in rows_dir.iterdir()) == [
        "mega_moe-bf16-seed0", "mega_moe-bf16-seed1", "mega_moe-fp8-seed1",
        "torch-bf16-seed0", "torch-bf16-seed1"]
    record = bench.merge(rows_dir, "seeds", (200, 300), "megamoe-train-bench --merge")
    cmp = record["comparison"]
    # Each run against mega_moe's run of its own seed.
    assert cmp["torch-bf16-seed0"]["mega_moe_speedup"] == pytest.approx(1.25)
    assert cmp["torch-bf16-seed1"]["mega_moe_speedup"] == pytest.approx(1.10)
    assert cmp["torch-bf16-seed0"]["loss_rel_diff_vs_mega_moe"] == pytest.approx(-0.005)
    assert cmp["torch-bf16-seed1"]["loss_rel_diff_vs_mega_moe"] == pytest.approx(0.01)
    assert "mega_moe-bf16-seed1" not in cmp  # another seed is not a repeat
    assert cmp["mega_moe-fp8-seed1"]["speedup_vs_torch_bf16"] == pytest.approx(110 / 80)
    assert cmp["mega_moe-fp8-seed1"]["loss_rel_diff_vs_mega_moe_bf16"] == pytest.approx(1.03 / 1.02 - 1)
    parity = record["parity_over_runs"]
    torch_parity = parity["torch-bf16"]
    assert torch_parity["rel_diff_by_seed"] == {"0": pytest.approx(-0.005), "1": pytest.approx(0.01)}
    assert torch_parity["rel_diff_by_seed_mean"] == pytest.approx(0.0025)
    assert parity["mega_moe-bf16"]["seed_spread"] == pytest.approx(0.02 / 1.01)
    table = bench.format_table(record)
    assert "torch-bf16 against mega_moe seed by seed: seed 0 -0.50%, seed 1 +1.00% (mean +0.25%)" in table
    assert "mega_moe-bf16: its seeds' mean losses span 1.98%" in table
    assert bench.plot(record, tmp_path / "seeds.png").stat().st_size > 0


@pytest.mark.parametrize("extra,message", [
    (["--seeds", "0,x"], "--seeds: expected distinct integers"),
    (["--seeds", "1,1"], "--seeds: expected distinct integers"),
    (["--seeds", "0,1", "--train.seed", "3"], "--seeds and --train.seed"),
])
def test_bad_seeds_are_refused(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["default-cpu", "--out-dir", str(tmp_path), *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bench_checks_every_config_before_running(tmp_path, capsys):
    code = bench.main(["default-cpu", "--backends", "mega_moe,torch", "--out-dir", str(tmp_path),
                       "--train.stepz", "3"])
    assert code == 2
    assert "train.stepz: unknown key" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert bench.main(["--merge", "--name", "nothing", "--out-dir", str(tmp_path)]) == 1


def test_steps_keep_the_full_runs_schedule_only_when_shorter():
    from megamoe.train import config as config_mod

    base = config_mod.load("default-cpu", [("train.steps", "40")])
    assert bench.schedule_overrides(base, 20) == [("optim.decay_steps", "40")]
    assert bench.schedule_overrides(base, 300) == []  # decays over its own 300 steps
    assert bench.schedule_overrides(base, None) == []
    fixed = config_mod.load("default-cpu", [("optim.decay_steps", "50")])
    assert bench.schedule_overrides(fixed, 20) == []  # the config's own decay stands


def test_a_committed_record_gives_back_rows_that_merge_into_it(tmp_path):
    # tools/record_rows.py: a record's rows written out again and merged with a new row keep
    # every field of the record; what the new row adds joins its comparisons.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows_dir = tmp_path / "a.rows"
    for row in (_row("mega_moe", [3.0, 2.0], 100.0, seed=0), _row("torch", [3.0, 2.2], 120.0, seed=0)):
        rows_dir.mkdir(exist_ok=True)
        (rows_dir / f"{bench._row_key(row)}.json").write_text(json.dumps(row))
    record = bench.merge(rows_dir, "a", (1, 2), "first")
    (tmp_path / "a.json").write_text(json.dumps(record))
    out = tmp_path / "again" / "a.rows"
    subprocess.run([sys.executable, str(root / "tools" / "record_rows.py"), str(tmp_path / "a.json"),
                    str(out)], check=True, capture_output=True)
    assert bench.merge(out, "a", (1, 2), "first") == record
    hf = _row("hf", [3.0, 1.8], 150.0, seed=0)
    (out / f"{bench._row_key(hf)}.json").write_text(json.dumps(hf))
    again = bench.merge(out, "a", (1, 2), "second")
    assert again["rows"][:2] == record["rows"][:2] and len(again["rows"]) == 3
    assert again["comparison"]["hf-bf16-seed0"]["mega_moe_speedup"] == pytest.approx(1.5)


def test_against_compares_rows_with_another_records(tmp_path):
    """--against: the EP=2 record's rows against the EP=1 record's of the same backend."""
    one, two = tmp_path / "ep1", tmp_path / "ep2"
    one.mkdir()
    two.mkdir()
    base = [5.0 - 0.01 * i for i in range(40)]
    # One 10-step block 3% higher: the largest gap, and 0.75% over the 40 steps.
    bumped = base[:20] + [v * 1.03 for v in base[20:30]] + base[30:]
    (one / "mega_moe-bf16.json").write_text(json.dumps(_row("mega_moe", base, 100.0)))
    (two / "mega_moe-bf16.json").write_text(json.dumps(_row("mega_moe", bumped, 98.0)))
    (two / "torch-bf16.json").write_text(json.dumps(_row("torch", base[:25], 130.0)))
    other = bench.merge(one, "ep1", (31, 40), "one")
    record = bench.merge(two, "ep2", (31, 40), "two", against=other)
    against = record["against"]
    assert against["record"] == "ep1" and set(against["rows"]) == {"mega_moe-bf16"}
    entry = against["rows"]["mega_moe-bf16"]
    assert entry["step_time_ratio"] == pytest.approx(0.98)
    assert entry["loss_rel_diff_window"] == pytest.approx(0.0)
    assert entry["steps_compared"] == 40 and entry["bitwise_identical_steps"] == 20
    assert entry["max_rel_gap_10_step_means"] == pytest.approx(0.03)
    assert entry["max_gap_steps"] == [21, 30]
    assert entry["loss_rel_diff_all_steps"] == pytest.approx(
        0.03 * sum(base[20:30]) / sum(base))
    table = bench.format_table(record)
    assert "mega_moe-bf16 against ep1: step time 0.980x" in table and "+3.00% (steps 21-30)" in table


def test_against_and_nproc_per_node_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["default-cpu", "--merge", "--against", str(tmp_path / "missing.json")])
    assert "--against" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["default-cpu", "--nproc-per-node", "0"])
    assert "--nproc-per-node: must be >= 1" in capsys.readouterr().err


def test_nproc_per_node_launches_torchrun(tmp_path, monkeypatch):
    seen = []

    class Done(Exception):
        pass

    def popen(cmd, **kwargs):
        seen.append(cmd)
        raise Done

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    args = bench.build_parser().parse_args(["default-cpu", "--nproc-per-node", "2", "--no-parts"])
    with pytest.raises(Done):
        bench.run_one(args, [], "torch", "bf16", 1, tmp_path, "cmd")
    assert seen[0][1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "-m"] and seen[0][6] == "megamoe.train"
