"""tools/ab_outputs.py's fingerprints on the CPU: equal outputs compare equal, and one
changed value in a large output (beyond the sample) is still caught by the digest."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import ab_outputs  # noqa: E402

from moe_testing import BASE_SEED  # noqa: E402


def _dumps(tmp_path, change):
    g = torch.Generator().manual_seed(BASE_SEED)
    # Larger than the sample, so that most of its values are seen by the digest alone.
    big = torch.randn(3 * ab_outputs.SAMPLE + 5, generator=g).to(torch.bfloat16)
    small = torch.randn(7, 3, generator=g)
    ids = torch.randint(-1, 8, (33,), generator=g)
    paths = []
    for tag in ("a", "b"):
        out = {"big": big.clone(), "small": small.clone(), "ids": ids.clone(),
               "scalar": torch.tensor(1.5)}
        if tag == "b":
            change(out)
        path = tmp_path / f"{tag}.pt"
        torch.save(ab_outputs.fingerprints(out), path)
        paths.append(path)
    return paths


def test_equal_dumps_compare_equal(tmp_path, capsys):
    a, b = _dumps(tmp_path, lambda out: None)
    assert ab_outputs.compare(a, b) == 0
    assert "4 of 4 outputs bitwise equal" in capsys.readouterr().out


def test_a_value_off_the_sample_is_caught(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ab_outputs, "_CHUNK", 4096)  # many chunks, hashed in threads
    step = ab_outputs.fingerprint(torch.zeros(3 * ab_outputs.SAMPLE + 5))["sample_step"]
    assert step > 1

    def change(out):
        out["big"][step + 1] += 1.0
    a, b = _dumps(tmp_path, change)
    assert ab_outputs.compare(a, b) == 1
    text = capsys.readouterr().out
    assert "DIFF  big" in text and "0 of" in text and "3 of 4 outputs bitwise equal" in text


def test_a_changed_dtype_or_shape_differs(tmp_path, capsys):
    a, b = _dumps(tmp_path, lambda out: out.update(small=out["small"].double(),
                                                     ids=out["ids"][:-1]))
    assert ab_outputs.compare(a, b) == 1
    assert "2 of 4 outputs bitwise equal" in capsys.readouterr().out
