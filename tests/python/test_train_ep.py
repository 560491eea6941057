"""Expert parallelism through the trainer on CPU: two gloo processes, megamoe's torch
backend (all_to_all between the EP ranks). An EP=2 run gives the losses of an EP=1 run of
the same two ranks (pure FSDP2), and a checkpoint written at EP=2 resumes bitwise at EP=2
and at EP=1 (so it holds the global experts tensors, not two ranks' halves)."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, store_path, corpus, out_dir, results):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from megamoe.train.trainer import main

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        common = ["default-cpu", "--data.paths", json.dumps([corpus]), "--data.seq_len", "32",
                  "--model.moe.dispatch.type", "torch", "--log.plot", "false",
                  "--optim.warmup_steps", "1"]

        def train(name, ep, steps, *extra):
            assert main(common + ["--parallel.ep", str(ep), "--train.steps", str(steps),
                                  "--log.dir", os.path.join(out_dir, name), *extra]) == 0

        train("ep2", 2, 4)
        train("ep1", 1, 4)
        train("split", 2, 2, "--optim.decay_steps", "4", "--checkpoint.interval", "2")
        train("split", 2, 4, "--checkpoint.resume", "latest")
        checkpoint = os.path.join(out_dir, "split", "checkpoints", "step-000002")
        train("to-ep1", 1, 4, "--checkpoint.resume", checkpoint)
    finally:
        dist.destroy_process_group()


def _losses(path):
    return [r["loss"] for r in json.loads(path.read_text())["steps"]]


def test_expert_parallel_matches_and_resumes(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n"
                              for i in range(400)))
    mp.start_processes(_worker, args=(2, str(tmp_path / "store"), str(corpus), str(tmp_path), None),
                       nprocs=2, join=True, start_method="spawn")
    ep2, ep1 = _losses(tmp_path / "ep2" / "run.json"), _losses(tmp_path / "ep1" / "run.json")
    assert len(ep2) == len(ep1) == 4
    # Different reduction orders (all_to_all vs local experts): equal to float rounding.
    assert ep2 == pytest.approx(ep1, rel=1e-5)
    assert ep2[-1] < ep2[0]
    assert _losses(tmp_path / "split" / "run.json") == ep2
    # A fresh log directory: the EP=1 run resumed from the EP=2 checkpoint logs steps 3-4.
    assert _losses(tmp_path / "to-ep1" / "run.json") == pytest.approx(ep1[2:], rel=1e-5)
