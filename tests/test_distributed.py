"""Rank helpers, in one process and in two real gloo processes launched by torchrun."""

import subprocess
import sys
import textwrap

import torch

from trainer.distributed import (
    all_gather,
    gather,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
    reduce_dict,
)


def test_single_process_fallbacks(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() == (0, 1)
    assert (get_rank(), get_world_size(), is_main_process()) == (0, 1, True)
    assert all_gather(3) == [3] and gather("a") == ["a"]
    assert reduce_dict({"x": torch.tensor(2.0)}) == {"x": torch.tensor(2.0)}


WORKER = """
import torch
from trainer.distributed import *
rank, world = init_distributed()
assert (rank, world) == (get_rank(), get_world_size()) and world == 2
assert all_gather(rank * 10) == [0, 10]
gathered = gather({"r": rank})
assert gathered == ([{"r": 0}, {"r": 1}] if rank == 0 else []), gathered
out = reduce_dict({"a": torch.tensor(float(rank)), "b": torch.tensor(4.0)})
assert out["a"].item() == 0.5 and out["b"].item() == 4.0, out
out = reduce_dict({"a": torch.tensor(1.0)}, average=False)
assert out["a"].item() == 2.0
print(f"rank {rank} ok", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def torchrun(args, timeout=120, **kwargs):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def test_collectives_across_two_gloo_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    result = torchrun([str(script)], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout
