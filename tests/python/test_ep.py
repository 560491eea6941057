"""Runs ep_check.py under torchrun: float32 over gloo on the CPU always; when this machine
has two or more GPUs, the torch backend in bf16 over NCCL and the fused backend over a
megamoe.Buffer at every precision (with a CUDA-graph replay; "fp8" also with the forward's
bf16 dispatch, MEGAMOE_EP_FP8_BF16_DISPATCH=1), and ep_dead_peer_check.py (a peer that
exits with no clean-up: a timeout error, not a hang); and ep_one_rank_check.py (the fused EP
ops at every precision on a one-rank group) on one GPU."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _torchrun(script, *extra, ranks=2, env=None, timeout=900, passed="EP check: PASSED"):
    """Runs tests/python/`script` under torchrun on `ranks` processes; it must exit 0 and
    print `passed` within `timeout` seconds. Past it, torchrun gets SIGTERM, which it passes
    to its workers (each runs in a session of its own, out of reach of a kill of torchrun
    alone), and what they printed is shown."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--standalone", str(Path(__file__).with_name(script)), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        err += f"\n{script}: no result within {timeout} s (a hang?)"
    print(out[-20000:])
    print(err[-5000:], file=sys.stderr)
    assert proc.returncode == 0, f"{script} failed (see output)"
    assert passed in out


def _run_ep_check(*extra, env=None):
    _torchrun("ep_check.py", *extra, env=env)


def test_torch_backend_ep2_matches_ep1_on_cpu():
    _run_ep_check("--cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two or more CUDA GPUs")
def test_torch_backend_ep2_matches_ep1_on_gpus():
    _run_ep_check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two or more CUDA GPUs")
@pytest.mark.parametrize("precision,env", [
    ("bf16", {}), ("fp8", {}), ("fp8_bwd", {}),
    ("fp8", {"MEGAMOE_EP_FP8_BF16_DISPATCH": "1"}),
], ids=["bf16", "fp8", "fp8_bwd", "fp8-bf16-dispatch"])
def test_fused_backend_ep2_matches_the_one_gpu_layer(precision, env):
    _run_ep_check("--backend", "fused", "--precision", precision, "--graph", env=env)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two or more CUDA GPUs")
def test_a_dead_peer_is_a_timeout_error_not_a_hang():
    # Rank 1 exits with no clean-up after a good call; rank 0's next calls come back within
    # one timeout per phase and raise the error naming rank 1 (ep_dead_peer_check.py).
    _torchrun("ep_dead_peer_check.py", timeout=300, passed="dead peer check: PASSED")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_ep_ops_on_one_rank_match_the_one_gpu_layer():
    # Every precision through the EP ops on a one-rank group (ep_one_rank_check.py).
    _torchrun("ep_one_rank_check.py", ranks=1, timeout=600, passed="EP one-rank check: PASSED")
