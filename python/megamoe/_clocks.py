"""The SM clock and board power of a GPU, sampled by nvidia-smi in the background.

Under the power cap the clock a run holds depends on what it runs (the layer's FP8
training calls hold a higher one than its bf16 ones), so a timing is read with the clock it
ran at. megamoe-bench records each row's mean clock and power; tools/power_probe.py reports
them beside sustained work.
"""

from __future__ import annotations

import csv
import os
import shutil
import statistics
import subprocess
import tempfile
import time

FIELDS = ["timestamp", "clocks.sm", "power.draw", "temperature.gpu",
          "clocks_event_reasons.sw_power_cap", "clocks_event_reasons.hw_slowdown"]


def gpu_selector(device) -> str:
    """What `nvidia-smi -i` takes for a torch CUDA device: its UUID, which stays right under
    CUDA_VISIBLE_DEVICES (torch's device indices are renumbered there, nvidia-smi's are not)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return str(torch.device(device).index or 0)
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def read_samples(path: str) -> list[tuple[float, float, float, str]]:
    """(unix time, SM MHz, watts, sw power cap flag) of each well-formed sample line."""
    samples = []
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) < 5:
                continue
            try:
                stamp, _, fraction = row[0].strip().partition(".")
                seconds = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S"))
                seconds += float("0." + fraction) if fraction else 0.0
                samples.append((seconds, float(row[1]), float(row[2]), row[4].strip()))
            except ValueError:
                continue
    return samples


def window_means(samples, start: float, end: float) -> tuple[float, float, float] | None:
    """Mean SM MHz, mean watts and the share of samples with the power cap active between
    two unix times; None when no sample falls there."""
    window = [s for s in samples if start <= s[0] <= end]
    if not window:
        return None
    return (statistics.mean(s[1] for s in window), statistics.mean(s[2] for s in window),
            sum(1 for s in window if s[3] == "Active") / len(window))


class ClockSampler:
    """nvidia-smi writing a sample every `period_ms` to `path` (a temporary file by default)
    until close(); samples() reads them back. Without nvidia-smi it samples nothing and
    `available` is False."""

    def __init__(self, gpu: str, period_ms: int = 50, path: str | None = None):
        self._owned = path is None
        if path is None:
            handle, path = tempfile.mkstemp(prefix="megamoe-clocks-", suffix=".csv")
            os.close(handle)
        self.path = path
        self._process = None
        if shutil.which("nvidia-smi") is not None:
            with open(path, "w") as out:
                self._process = subprocess.Popen(
                    ["nvidia-smi", "-i", gpu, f"--query-gpu={','.join(FIELDS)}",
                     "--format=csv,noheader,nounits", f"-lms={period_ms}"],
                    stdout=out, stderr=subprocess.DEVNULL)

    @property
    def available(self) -> bool:
        return self._process is not None

    def close(self) -> list[tuple[float, float, float, str]]:
        """Stops sampling; returns every sample taken (nvidia-smi's file output is buffered,
        so they are complete only now)."""
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._process = None
            samples = read_samples(self.path)
        else:
            samples = []
        if self._owned:
            os.unlink(self.path)
            self._owned = False
        return samples
