"""Rank helpers and the trainer's metric reduction, in one process and in two real gloo
processes launched by torchrun."""

import os
import re
import subprocess
import textwrap
import time
from subprocess import PIPE

import pytest
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
from trainer.misc import WorkDirLock

from conftest import communicate, cpu_env, popen, torchrun_command


def test_single_process_fallbacks(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() == (0, 1)
    assert (get_rank(), get_world_size(), is_main_process()) == (0, 1, True)
    assert all_gather(3) == [3] and gather("a") == ["a"]
    assert reduce_dict({"x": torch.tensor(2.0)}) == {"x": torch.tensor(2.0)}


def test_the_torchrun_side_is_one_object_under_each_documented_path():
    import trainer
    import trainer.distributed as distributed

    assert trainer.init_distributed is distributed.init_distributed is init_distributed
    assert trainer.reduce_dict is distributed.reduce_dict is reduce_dict


WORKER = """
import torch
from trainer.distributed import *
rank, world = init_distributed()
assert (rank, world) == (get_rank(), get_world_size()) and world == 2
assert all_gather(rank * 10) == [0, 10]
gathered = gather({"r": rank})
assert gathered == ([{"r": 0}, {"r": 1}] if rank == 0 else []), gathered
side = torch.distributed.new_group(backend="gloo")  # the same over another group
assert all_gather(rank * 10, group=side) == [0, 10]
assert gather(rank, group=side) == ([0, 1] if rank == 0 else [])
assert all_gather_tensor(torch.tensor([rank]), group=side).tolist() == [[0], [1]]
torch.distributed.destroy_process_group(side)
del side  # the last reference: its threads end now, while Python is alive
out = reduce_dict({"a": torch.tensor(float(rank)), "b": torch.tensor(4.0)})
assert out["a"].item() == 0.5 and out["b"].item() == 4.0, out
out = reduce_dict({"a": torch.tensor(1.0)}, average=False)
assert out["a"].item() == 2.0
print(f"rank {rank} ok", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def torchrun(args, timeout, env=None):
    cmd = torchrun_command("--nproc_per_node", "2", *args)
    proc = popen(cmd, stdout=PIPE, stderr=PIPE, text=True, env=env or cpu_env())
    stdout, stderr = communicate(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_collectives_across_two_gloo_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    result = torchrun([str(script)], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout


# How the training workers end (they import os and sys): every rank done talking, then tear down,
# and skip freeing the model and the interpreter's teardown: a gloo thread of the default group
# may still hold a tensor made in Python, and dropping it deadlocks with the DDP model freeing
# that group, or aborts while the interpreter exits (docs/internals.md: gloo teardown).
TEARDOWN = """
torch.distributed.barrier()
torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""

TRAIN_WORKER = (
    """
import io, os, sys, time
import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from trainer import HookBase, Trainer
from trainer.distributed import init_distributed
from trainer.hooks import BestCheckpointHook, CheckpointHook, EarlyStoppingHook, EvalHook
from trainer.hooks import checkpoint_hook, eval_hook

rank, world = init_distributed(timeout_s=float(os.environ.get("PG_TIMEOUT", 60)))
nan_at = int(os.environ.get("NAN_AT", -1))
fail_at = int(os.environ.get("FAIL_AT", -1))  # rank 1 raises after this iteration
hang_at = int(os.environ.get("HANG_AT", -1))  # rank 1 stalls for 15 s after this iteration


class RankLoss(nn.Module):
    # rank 0's loss is 1.0, rank 1's is 2.0; rank 1's turns NaN at iteration NAN_AT
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        loss = (self.w * batch).sum() + float(rank + 1)
        return loss * float("nan") if rank == 1 and self.calls - 1 == nan_at else loss


class Batches:  # rank 1's batches take 50 ms each; with SHORT=1, rank 1 has 6, not 8
    n = 6 if rank == 1 and os.environ.get("SHORT") else 8

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            if rank == 1:
                time.sleep(0.05)
            yield torch.zeros(1)


seen_counts = []  # total_loss's count in metric_storage, as a hook reads it after each iteration


class Fault(HookBase):
    def after_iter(self):
        storage = self.trainer.metric_storage
        seen_counts.append(storage["total_loss"].count if "total_loss" in storage else 0)
        if rank == 1 and self.trainer.cur_iter == fail_at:
            raise RuntimeError(f"injected failure on rank 1 at iteration {fail_at}")
        if rank == 1 and self.trainer.cur_iter == hang_at:
            time.sleep(15)


@record  # torchrun's summary then names the failing rank and shows its traceback
def main():
    model = torch.nn.parallel.DistributedDataParallel(RankLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, None, Batches(), max_iters=16, log_period=8,
                      work_dir=sys.argv[1], checkpoint_period=int(os.environ.get("CKPT", 100)),
                      preempt_check_period=int(os.environ.get("PREEMPT_CHECK", 10)))
    if os.environ.get("DISK_FULL") and rank == 0:
        real_save = torch.save

        def full_disk(obj, f, *args, **kwargs):  # as torch.save reports a full disk
            if isinstance(f, io.BytesIO):  # pickling for a collective, not a checkpoint
                return real_save(obj, f, *args, **kwargs)
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
        torch.save = full_disk
    trainer.register_hook(Fault())
    evals = {
        "shard": lambda: {"acc": float(rank)},  # each rank its own shard's number
        "rank0": lambda: {"acc": 0.75} if rank == 0 else None,  # rank 0 alone evaluates
        # better at every evaluation on rank 0; rank 1 drops after iteration 8, and the mean too
        "worse": lambda: {"acc": trainer.cur_iter / 100 - rank * (trainer.cur_iter > 8)},
    }
    # Every collective of torch.distributed while train() runs, and whether it went over the
    # trainer's group: on the default group, a gloo thread dropping a tensor made in Python can
    # deadlock with a DDP model freed after destroy_process_group() (docs/internals.md:
    # gloo teardown).
    collectives, on_default_group, training = [], [], []
    eval_groups = []  # per gather of EvalHook's results: whether it used the trainer's group

    def recorded(name, real):
        def call(*args, group=None, **kwargs):
            if training:
                collectives.append(name)
                if group is None or group is torch.distributed.group.WORLD:
                    on_default_group.append(name)
            return real(*args, group=group, **kwargs)
        return call

    real_reduce = eval_hook.reduce_over_ranks

    def reduce_results(totals, group=None, **kwargs):  # EvalHook's gather of its results
        eval_groups.append(group is not None and group is trainer.cpu_group)
        return real_reduce(totals, group, **kwargs)

    eval_hook.reduce_over_ranks = reduce_results
    for name in ("all_reduce", "all_gather", "all_gather_object", "gather_object", "gather",
                 "broadcast", "broadcast_object_list", "barrier", "reduce", "scatter"):
        setattr(torch.distributed, name, recorded(name, getattr(torch.distributed, name)))
    if os.environ.get("EVAL"):
        trainer.register_hook(EvalHook(4, evals[os.environ["EVAL"]]))
    if os.environ.get("EARLY_STOP"):
        trainer.register_hook(EarlyStoppingHook("acc", patience=1))
        trainer.register_hook(BestCheckpointHook("acc"))
    saves = []  # after how many iterations each checkpoint was saved

    class Saves(HookBase):
        def before_save_checkpoint(self):
            saves.append(self.trainer.cur_iter + 1)

    trainer.register_hook(Saves())
    if os.environ.get("TIMED"):  # rank 1's clock reads a minute per iteration, rank 0's stands
        trainer.unregister_hook(CheckpointHook)
        trainer.register_hook(CheckpointHook(0, every_minutes=5))
        checkpoint_hook.monotonic = lambda: 60.0 * (trainer.cur_iter + 1) * rank
    try:
        training.append(True)
        trainer.train()
        training.clear()
        s = trainer.metric_storage
        print(f"rank {rank}: loss {s['total_loss'].latest} count {s['total_loss'].count} "
              f"data_time {s['data_time'].latest:.3f}", flush=True)
        print(f"rank {rank}: counts seen {seen_counts}", flush=True)
        if os.environ.get("EVAL"):
            print(f"rank {rank}: acc {s['acc'].latest} count {s['acc'].count}", flush=True)
            print(f"rank {rank}: results gathered over the trainer's group {eval_groups}")
        print(f"rank {rank}: stopped after {trainer.cur_iter + 1}", flush=True)
        print(f"rank {rank}: saved after {saves}", flush=True)
        print(f"rank {rank}: {len(collectives)} collectives, over the default group "
              f"{on_default_group}", flush=True)
    except FloatingPointError as e:
        print(f"rank {rank} raised: {e}", flush=True)


main()
"""
    + TEARDOWN
)


def run_train_worker(tmp_path, **env):
    script = tmp_path / "train_worker.py"
    script.write_text(textwrap.dedent(TRAIN_WORKER))
    full_env = cpu_env(**{k: str(v) for k, v in env.items()})
    result = torchrun([str(script), str(tmp_path / "work")], timeout=90, env=full_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_logged_metrics_are_reduced_over_ranks_at_log_points(tmp_path):
    out = run_train_worker(tmp_path)
    for rank in (0, 1):  # the mean of 1.0 and 2.0; the slower rank's data time, on both ranks
        line = re.search(rf"rank {rank}: loss ([\d.]+) count (\d+) data_time ([\d.]+)", out)
        assert line, out
        assert float(line.group(1)) == 1.5 and int(line.group(2)) == 16
        assert float(line.group(3)) >= 0.045
        # what a hook reads: the reduced values of each log point (8 iterations), as in one
        # process (test_trainer.py::test_hooks_read_the_metrics_of_the_last_log_point)
        assert f"rank {rank}: counts seen {[0] * 7 + [8] * 8 + [16]}" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, {"EVAL": "shard", "CKPT": 4, "PREEMPT_CHECK": 2}])
def test_the_trainer_keeps_its_collectives_off_the_default_group(tmp_path, env):
    """The reduction, preemption checks, saves and evaluations go over the trainer's gloo group:
    a gloo thread of the default group that drops a tensor made in Python as a DDP model frees
    that group (with the GIL held) deadlocks the process at exit (docs/internals.md: gloo
    teardown)."""
    out = run_train_worker(tmp_path, **env)
    for rank in (0, 1):
        # up to its "]": the two ranks' lines may interleave in the pipe
        line = re.search(rf"rank {rank}: (\d+) collectives, over the default group (\[.*?\])", out)
        assert line, out
        assert int(line.group(1)) >= 4 and line.group(2) == "[]", out


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_makes_every_rank_raise_at_that_iteration(tmp_path):
    out = run_train_worker(tmp_path, NAN_AT=5)
    for rank in (0, 1):
        # cur_iter 5: the 6th iteration, of the first epoch (of 8)
        assert f"rank {rank} raised: Loss became NaN or infinite at iteration 6 (epoch 1)" in out


@pytest.mark.slow
@pytest.mark.parametrize("how, acc", [("shard", 0.5), ("rank0", 0.75)])
def test_evaluation_results_are_the_same_on_every_rank(tmp_path, how, acc):
    out = run_train_worker(tmp_path, EVAL=how)
    for rank in (0, 1):  # evaluated after iterations 4, 8, 12 and 16
        assert f"rank {rank}: acc {acc} count 4" in out, out
        # not over the default group, whose gloo threads outlive training (see CpuGroup)
        assert f"rank {rank}: results gathered over the trainer's group {[True] * 4}" in out, out


@pytest.mark.slow
def test_early_stopping_and_best_checkpoint_decide_alike_on_every_rank(tmp_path):
    out = run_train_worker(tmp_path, EVAL="worse", EARLY_STOP=1)
    for rank in (0, 1):  # the mean: 0.03 after iteration 4, 0.07 after 8, -0.39 after 12
        assert f"rank {rank}: stopped after 12" in out, out
    best = torch.load(tmp_path / "work" / "checkpoints" / "best.pth", weights_only=True)
    # evaluated best after iteration 8, the end of the first epoch of 8 batches
    assert (best["progress"]["epoch"], best["progress"]["inner_iter"]) == (1, 0)


@pytest.mark.slow
def test_a_timed_save_comes_at_one_iteration_on_every_rank_and_is_written_once(tmp_path):
    # rank 1's clock says 5 minutes are up at the log point after iteration 8, rank 0's does not
    out = run_train_worker(tmp_path, TIMED=1, PG_TIMEOUT=20)
    for rank in (0, 1):
        assert f"rank {rank}: saved after [8, 16]" in out, out
    work = tmp_path / "work"
    assert sorted(os.listdir(work / "checkpoints")) == ["iter_16.pth", "iter_8.pth", "latest.txt"]
    logs = (work / "log.txt").read_text(), (work / "log_rank1.txt").read_text()
    assert [log.count("Writing checkpoint") for log in logs] == [2, 0]  # rank 0 writes


def run_failing_worker(tmp_path, **env):
    """The train worker with a fault injected on rank 1."""
    script = tmp_path / "train_worker.py"
    script.write_text(textwrap.dedent(TRAIN_WORKER))
    full_env = cpu_env(**{k: str(v) for k, v in env.items()})
    return torchrun([str(script), str(tmp_path / "work")], timeout=90, env=full_env)


@pytest.mark.slow
def test_an_exception_on_one_rank_ends_the_job_and_names_the_rank(tmp_path):
    result = run_failing_worker(tmp_path, FAIL_AT=5)
    assert result.returncode == 1
    # torchrun's summary (from @record): the root cause is rank 1, with its traceback
    root_cause = result.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root_cause), result.stderr[-3000:]
    assert "RuntimeError: injected failure on rank 1 at iteration 5" in root_cause
    log = (tmp_path / "work" / "log_rank1.txt").read_text()
    assert "Training failed in iteration 6 of " in log and "injected failure" in log


@pytest.mark.slow
def test_a_failed_checkpoint_write_on_rank_0_ends_every_rank_promptly(tmp_path):
    # rank 0's write of iter_8.pth fails; the ranks agree on it at a preemption check, long
    # before the process group's 60 s timeout
    start = time.monotonic()
    result = run_failing_worker(tmp_path, DISK_FULL=1, CKPT=1, PREEMPT_CHECK=2, PG_TIMEOUT=60)
    assert result.returncode == 1
    assert time.monotonic() - start < 45, result.stderr[-3000:]
    log0 = (tmp_path / "work" / "log.txt").read_text()
    log1 = (tmp_path / "work" / "log_rank1.txt").read_text()
    assert re.search(r"OSError: \[Errno 28\] Could not write .*iter_8\.pth: No space left", log0)
    assert "Rank 0 could not write a checkpoint: its log names the file" in log1
    assert "Timed out" not in result.stderr


@pytest.mark.slow
def test_ranks_whose_data_loaders_differ_in_length_fail_at_once_naming_both(tmp_path):
    start = time.monotonic()
    result = run_failing_worker(tmp_path, SHORT=1, PG_TIMEOUT=60)
    assert result.returncode == 1
    assert time.monotonic() - start < 45, result.stderr[-3000:]  # not the 60 s timeout
    message = "Ranks' data_loaders differ in length ([8, 6])"
    assert result.stderr.count(message) >= 2, result.stderr[-3000:]  # both ranks raise it


@pytest.mark.slow
def test_a_work_dir_in_use_refuses_every_rank_through_rank_0s_lock(tmp_path):
    (tmp_path / "work").mkdir()
    with WorkDirLock(str(tmp_path / "work")).held():  # as another run would
        start = time.monotonic()
        result = run_failing_worker(tmp_path, PG_TIMEOUT=60)
    assert result.returncode == 1
    assert time.monotonic() - start < 45, result.stderr[-3000:]
    assert f"{tmp_path / 'work'} is in use by another run (pid {os.getpid()}" in result.stderr
    assert "Rank 0: " + str(tmp_path / "work") + " is in use by another run" in result.stderr
    assert not os.path.exists(tmp_path / "work" / "checkpoints" / "iter_16.pth")


@pytest.mark.slow
def test_a_stalled_rank_makes_the_others_fail_after_the_process_group_timeout(tmp_path):
    # rank 1 stalls for 15 s; rank 0 gives up at its next collective after 5 s
    result = run_failing_worker(tmp_path, HANG_AT=5, PG_TIMEOUT=5)
    assert result.returncode == 1
    assert "Timed out waiting 5000ms" in result.stderr, result.stderr[-3000:]


ACCUMULATION_WORKER = (
    """
import os, sys, threading
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard
from trainer import Trainer
from trainer.distributed import init_distributed

rank, world = init_distributed()
reductions = {"n": 0}


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)


def counting_allreduce(state, bucket):
    reductions["n"] += 1
    return allreduce_hook(state, bucket)


torch.manual_seed(0)
net = Regression()
if sys.argv[2] == "ddp":
    model = nn.parallel.DistributedDataParallel(net)
    model.register_comm_hook(None, counting_allreduce)
else:
    # what FSDP2 reduces gradients with: reduce_scatter_single in newer torch versions
    name = next(n for n in ("reduce_scatter_single", "reduce_scatter_tensor")
                if hasattr(torch.distributed, n))
    real = getattr(torch.distributed, name)

    def counting(*args, **kwargs):
        reductions["n"] += 1
        return real(*args, **kwargs)

    setattr(torch.distributed, name, counting)
    model = fully_shard(net)
batches = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(8)]
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = Trainer(model, optimizer, None, batches, max_iters=4, accumulation_steps=2,
                  work_dir=sys.argv[1], log_period=2, checkpoint_period=2, preempt_check_period=1)


def native_threads():  # gloo's among them
    return len(os.listdir("/proc/self/task")) - threading.active_count()


before = native_threads()
trainer.train()
print(f"rank {rank}: {reductions['n']} gradient reductions in 4 iterations", flush=True)
print(f"rank {rank}: native threads {before} before train(), {native_threads()} after", flush=True)
"""
    + TEARDOWN
)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_accumulation_reduces_gradients_once_per_iteration(tmp_path, wrapper):
    """DDP's no_sync and FSDP2's set_requires_gradient_sync(False) on the first micro-batch:
    4 iterations of 2 micro-batches make 4 gradient reductions, not 8."""
    script = tmp_path / "worker.py"
    script.write_text(ACCUMULATION_WORKER)
    result = torchrun([str(script), str(tmp_path / "work"), wrapper], timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: 4 gradient reductions in 4 iterations" in result.stdout
        # The trainer's own gloo group (preemption checks, the metrics and the saves' gathers)
        # is released when train() ends, its threads joined: none is left to drop a tensor
        # made in Python while the interpreter exits, which aborts the process.
        before, after = re.search(
            rf"rank {rank}: native threads (\d+) before train\(\), (\d+)", result.stdout
        ).groups()
        assert after == before, result.stdout


def readme_torchrun_recipe_with_fsdp2():
    """The torchrun recipe of docs/distributed.md, its model sharded as its FSDP2 section says,
    and the full weights gathered after training (a collective on the default group just before
    the teardown, which made about 1 run in 5 abort at exit with a barrier of the default group)."""
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "distributed.md")).read()
    recipe = re.search(r"```python\n(.*?)```", page, re.DOTALL).group(1)
    wrap = "        model = DistributedDataParallel(model)  # or shard it with FSDP2, below\n"
    train = "    Trainer(model, optimizer, None, loader, max_epochs=10).train()\n"
    assert wrap in recipe and train in recipe and "\ndestroy_distributed()" not in recipe
    recipe = recipe.replace(
        wrap,
        "        for block in model.blocks:  # each block, then the root\n"
        "            fully_shard(block)\n"
        "        fully_shard(model)\n",
    ).replace(
        train,  # 2 epochs of 2 iterations, not 10: what ends badly is the exit, not the training
        train.replace("max_epochs=10", "max_epochs=2")
        + "    full = get_model_state_dict(model, options=StateDictOptions("
        "full_state_dict=True, cpu_offload=True))\n"
        "    if rank == 0:\n"
        "        torch.save(full, 'weights.pth')\n",
    )
    setup = """
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank, for fully_shard
        self.blocks = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 1)])

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.blocks[1](self.blocks[0](x).relu()), y)

g = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g))
"""
    return setup + recipe


@pytest.mark.slow
def test_fsdp2_runs_of_the_documented_recipe_end_with_status_0(tmp_path):
    """Ten runs in a row (five, each run again on its finished work_dir) exit cleanly: no rank
    aborts at exit with "terminate called without an active exception"."""
    script = tmp_path / "train.py"
    script.write_text(readme_torchrun_recipe_with_fsdp2())
    for i in range(10):
        cwd = tmp_path / f"run{i // 2}"  # the second run of each resumes the finished one
        cwd.mkdir(exist_ok=True)
        cmd = torchrun_command("--nproc_per_node", "2", str(script))
        proc = popen(cmd, cwd=cwd, stdout=PIPE, stderr=PIPE, text=True, env=cpu_env())
        _, stderr = communicate(proc, timeout=90)
        assert proc.returncode == 0 and "terminate called" not in stderr, (i, stderr[-3000:])
        assert ("Nothing to train" in stderr) == (i % 2 == 1), stderr[-3000:]
        assert torch.load(cwd / "weights.pth", weights_only=True).keys() == {
            "blocks.0.weight",
            "blocks.0.bias",
            "blocks.1.weight",
            "blocks.1.bias",
        }
