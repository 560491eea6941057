"""tools/determinism_probe.py on the tiny CPU model: two runs of one config record the same
checksums, and `compare` names the first step and gradient where two logs differ."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import determinism_probe  # noqa: E402

from megamoe.train import optim as optim_mod  # noqa: E402
from megamoe.train import trainer  # noqa: E402


def _record(path: Path, log_dir: Path) -> None:
    args = argparse.Namespace(out=path, stop_after=2)
    rest = ["default-cpu", "--train.steps", "4", "--log.dir", str(log_dir), "--log.plot", "false"]
    assert determinism_probe.record(args, rest) == 0


def test_two_runs_agree_and_a_changed_gradient_is_named(tmp_path, capsys):
    clip_and_step, train_loop = optim_mod.clip_and_step, trainer._train_loop
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _record(a, tmp_path / "run-a")
    _record(b, tmp_path / "run-b")
    # The probe leaves the trainer as it found it.
    assert optim_mod.clip_and_step is clip_and_step and trainer._train_loop is train_loop
    lines = [json.loads(line) for line in b.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["calls"] and lines[0]["grads"]
    assert any(name.endswith("experts.down_proj") for name, _ in lines[0]["grads"])
    assert determinism_probe.compare(a, b) == 0

    name = lines[1]["grads"][-1][0]
    lines[1]["grads"][-1][1] += 1
    b.write_text("".join(json.dumps(line) + "\n" for line in lines))
    capsys.readouterr()
    assert determinism_probe.compare(a, b) == 1
    out = capsys.readouterr().out
    assert "first difference at step 2" in out
    assert "every one of the" in out and name in out
