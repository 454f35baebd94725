"""Real fault injection: training processes killed (SIGKILL), preempted (SIGTERM, SIGUSR1) and
rerun must end with the same weights, bit for bit, as one uninterrupted run."""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from trainer import HookBase
from trainer.sharded_checkpoint import STATE_FILE

from conftest import (
    TinyModel,
    build,
    communicate,
    cpu_env,
    failure_output,
    popen,
    save_checkpoint_file,
    torchrun_command,
)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_worker.py")


def start(work_dir, out, *, fresh=False, **env):
    """The worker in a process of its own; ``fresh``: from a fresh interpreter, not forked
    (``conftest.popen``)."""
    full_env = cpu_env(WORK_DIR=str(work_dir), OUT=str(out), MODE="epoch")
    full_env.update({k: str(v) for k, v in env.items()})
    return (subprocess.Popen if fresh else popen)(
        [sys.executable, WORKER],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(work_dir, out, **env):
    proc = start(work_dir, out, **env)
    _, stderr = communicate(proc, timeout=90)
    return proc.returncode, stderr


def start_torchrun(work_dir, out, *, args=(), **env):
    """The worker under torchrun, two ranks on gloo; ``args`` go to torchrun."""
    cmd = torchrun_command("--nproc_per_node", "2", *args, WORKER)
    full_env = cpu_env(WORK_DIR=str(work_dir), OUT=str(out), MODE="epoch")
    full_env.update({k: str(v) for k, v in env.items()})
    return popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def torchrun(work_dir, out, *, args=(), **env):
    proc = start_torchrun(work_dir, out, args=args, **env)
    _, stderr = communicate(proc, timeout=90)
    return proc.returncode, stderr


def load(path):
    return torch.load(path, weights_only=True)


def assert_bit_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of uninterrupted runs, per (mode, num_workers, stream)."""
    cache = {}

    def get(mode="epoch", num_workers=0, stream=0):
        key = mode, num_workers, stream
        if key not in cache:
            root = tmp_path_factory.mktemp(f"ref-{mode}-{num_workers}-{stream}")
            code, err = run(
                root / "work", root / "out.pth", MODE=mode, NUM_WORKERS=num_workers, STREAM=stream
            )
            assert code == 0, failure_output(err)
            cache[key] = load(root / "out.pth")
        return cache[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, num_workers, kill",
    [
        ("epoch", 0, {"KILL_AT_ITER": 13}),  # mid-epoch (epochs are 10 iterations)
        ("epoch", 2, {"KILL_AT_ITER": 21}),
        ("iter", 0, {"KILL_AT_ITER": 7}),
        ("iter", 2, {"KILL_AT_ITER": 18}),
        ("epoch", 0, {"KILL_IN_SAVE": 3}),  # halfway through writing a checkpoint
        ("iter", 0, {"KILL_IN_SAVE": 4}),
        ("epoch", 0, {"KILL_BEFORE_POINTER": 2}),  # file written, latest.txt not moved yet
    ],
)
def test_sigkill_then_rerun_is_bit_exact(tmp_path, reference, mode, num_workers, kill):
    work, out = tmp_path / "work", tmp_path / "out.pth"
    code, _ = run(work, out, MODE=mode, NUM_WORKERS=num_workers, **kill)
    assert code == -signal.SIGKILL and not out.exists()
    code, err = run(work, out, MODE=mode, NUM_WORKERS=num_workers)
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err
    if "KILL_IN_SAVE" in kill:
        assert "left by an interrupted checkpoint write" in err  # the stray temp file
    assert_bit_equal(load(out), reference(mode, num_workers))


@pytest.mark.slow
@pytest.mark.parametrize("num_workers, kill_at", [(0, 13), (2, 17)])
def test_a_stream_killed_then_rerun_is_bit_exact(tmp_path, reference, num_workers, kill_at):
    """A StatefulDataLoader over a stream (passes of 5 iterations) resumes from its own state,
    in mid-pass; its pass draws its order from torch's RNG, which resumes too."""
    work, out = tmp_path / "work", tmp_path / "out.pth"
    env = {"MODE": "iter", "NUM_WORKERS": num_workers, "STREAM": 1}
    code, _ = run(work, out, KILL_AT_ITER=kill_at, KILL_WHEN_SAVED=1, **env)
    assert code == -signal.SIGKILL and not out.exists()
    code, err = run(work, out, **env)
    assert code == 0, failure_output(err)
    assert f"Resumed from checkpoint {work / 'checkpoints'}/iter_{kill_at // 3 * 3}.pth" in err
    assert "from the state of the StatefulDataLoader" in err
    assert_bit_equal(load(out), reference("iter", num_workers, stream=1))


@pytest.mark.slow
def test_a_stream_with_uneven_shards_under_torchrun_killed_then_rerun_is_bit_exact(tmp_path):
    """Rank 0's shard has 5 batches, rank 1's 4: every pass ends on both ranks after 4 (or
    rank 0 would step alone, and hang). Killed in mid-pass, rerun, it ends as an uninterrupted
    run does."""
    env = {"MODE": "iter", "STREAM": 1}
    code, err = torchrun(tmp_path / "whole", tmp_path / "whole.pth", **env)
    assert code == 0, failure_output(err)
    assert "epoch 2 [1]  iter 5/25" in (tmp_path / "whole" / "log.txt").read_text()
    code, _ = torchrun(
        tmp_path / "cut", tmp_path / "cut.pth", KILL_AT_ITER=7, KILL_WHEN_SAVED=1, **env
    )
    assert code != 0 and not (tmp_path / "cut.pth").exists()
    code, err = torchrun(tmp_path / "cut", tmp_path / "cut.pth", **env)
    assert code == 0, failure_output(err)
    assert "from the state of the StatefulDataLoader, after the 2 batches" in err
    assert_bit_equal(load(tmp_path / "cut.pth"), load(tmp_path / "whole.pth"))


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    """Final weights of an uninterrupted run under torchrun (two ranks)."""
    root = tmp_path_factory.mktemp("ref-torchrun")
    code, err = torchrun(root / "work", root / "out.pth")
    assert code == 0, failure_output(err)
    return load(root / "out.pth")


@pytest.mark.slow
def test_sigkill_under_torchrun_then_rerun_is_bit_exact(tmp_path, torchrun_reference):
    """Two ranks (gloo): each rank's RNG state is in the checkpoint, so both resume exactly."""
    code, _ = torchrun(tmp_path / "cut", tmp_path / "cut.pth", KILL_AT_ITER=7)  # epochs of 5
    assert code != 0 and not (tmp_path / "cut.pth").exists()
    code, err = torchrun(tmp_path / "cut", tmp_path / "cut.pth")
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err
    assert_bit_equal(load(tmp_path / "cut.pth"), torchrun_reference)


@pytest.mark.slow
def test_elastic_restart_after_a_killed_worker_is_bit_exact(tmp_path, torchrun_reference):
    """torchrun --max-restarts 1: rank 1 dies, torchrun restarts both ranks, they resume from
    the latest checkpoint and finish as if nothing happened."""
    out = tmp_path / "out.pth"
    args = ["--max-restarts", "1"]
    # rank 1 of the new attempt then finds the old attempt's address of rank 0 first, if any
    faults = {"KILL_AT_ITER": 7, "KILL_RANK": 1, "RESTART_DELAY": 3}
    code, err = torchrun(tmp_path / "work", out, args=args, **faults)
    assert code == 0, failure_output(err)
    assert "failed (exitcode: -9) local_rank: 1" in err  # torchrun saw rank 1 killed
    assert "Resumed from checkpoint" in err and "after iteration 6" in err  # saved every 3
    assert_bit_equal(load(out), torchrun_reference)


@pytest.mark.slow
def test_resume_with_one_process_instead_of_two_maps_the_data_position(tmp_path):
    work = tmp_path / "work"
    # epochs of 5 iterations; the latest checkpoint: epoch 1 after 1 iteration of 2 ranks x 4
    # samples (written at iteration 6: the kill waits for it, or it could land before the
    # background write ends and leave iter_3.pth the latest)
    code, _ = torchrun(work, tmp_path / "cut.pth", KILL_AT_ITER=7, KILL_WHEN_SAVED=1)
    assert code != 0
    code, err = run(work, tmp_path / "out.pth", DIST_SAMPLER=1, BATCH=3)
    assert code == 1 and "(1 of 5 iterations, 8 samples)" in err and "cannot continue" in err
    record = tmp_path / "seen.txt"
    code, err = run(work, tmp_path / "out.pth", DIST_SAMPLER=1, RECORD=record)
    assert code == 0, failure_output(err)
    assert (
        "with 2 processes x batches of 4 to 1 x 4: epoch 2 stopped after 1 iterations = 8 "
        "samples, so this run goes on with iteration 3 of 10 of that epoch" in err
    )
    seen = [int(i) for i in record.read_text().split()]
    # A DistributedSampler's order is torch.randperm seeded with seed + epoch, for any world
    # size: the run goes on with exactly the 32 samples epoch 1 had left, then all of epoch 2.
    epoch_1 = torch.randperm(40, generator=torch.Generator().manual_seed(0 + 1)).tolist()
    assert seen[:32] == epoch_1[8:]
    assert sorted(seen[32:]) == list(range(40))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """An uninterrupted run under torchrun with the model sharded by fully_shard (FSDP2) and
    gradients clipped (their norm is about 2, so clipping at 0.05 acts in every step)."""
    root = tmp_path_factory.mktemp("fsdp")
    code, err = torchrun(root / "work", root / "out.pth", SHARD=1, CLIP=0.05)
    assert code == 0, failure_output(err)
    return root


@pytest.mark.slow
def test_ddp_on_two_ranks_trains_as_one_process_on_the_global_batch(tmp_path):
    # without dropout; a DistributedSampler gives the one process the same batches of 8 that
    # the two ranks split 4 + 4, and DDP averages the two ranks' gradients
    code, err = torchrun(tmp_path / "w2", tmp_path / "ddp.pth", DROPOUT=0)
    assert code == 0, failure_output(err)
    code, err = run(tmp_path / "w1", tmp_path / "one.pth", DROPOUT=0, DIST_SAMPLER=1, BATCH=8)
    assert code == 0, failure_output(err)
    ddp, one = load(tmp_path / "ddp.pth"), load(tmp_path / "one.pth")
    for name in ddp:
        torch.testing.assert_close(ddp[name], one[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_trains_as_ddp_does_and_its_checkpoint_loads_into_a_plain_model(tmp_path, fsdp_run):
    code, err = torchrun(tmp_path / "work", tmp_path / "ddp.pth", CLIP=0.05)
    assert code == 0, failure_output(err)
    fsdp, ddp = load(fsdp_run / "out.pth"), load(tmp_path / "ddp.pth")
    assert fsdp.keys() == ddp.keys()
    for name in fsdp:  # a per-shard gradient norm would clip differently
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=1e-6, atol=1e-7)
    # the last checkpoint is sharded: a folder of each rank's shards, with rank 0's
    # trainer.pth; one command turns it into one file of the full weights
    ckpt_dir = fsdp_run / "work" / "checkpoints"
    folder = ckpt_dir / (ckpt_dir / "latest.txt").read_text().strip()
    assert sorted(os.listdir(folder)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "checksums.json",
        STATE_FILE,
    ]
    command = [sys.executable, "-m", "trainer.sharded_checkpoint", str(folder), str(tmp_path / "m")]
    subprocess.run(command, env=cpu_env(), check=True, capture_output=True)
    plain = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    plain.load_state_dict({k.removeprefix("net."): v for k, v in load(tmp_path / "m").items()})
    assert_bit_equal(plain.state_dict(), {k.removeprefix("net."): v for k, v in fsdp.items()})


@pytest.mark.slow
def test_fsdp2_full_checkpoints_hold_the_whole_state_in_one_file(tmp_path, fsdp_run):
    code, err = torchrun(tmp_path / "work", tmp_path / "out.pth", SHARD=1, CLIP=0.05, FULL_CKPT=1)
    assert code == 0, failure_output(err)
    fsdp = load(fsdp_run / "out.pth")
    assert_bit_equal(load(tmp_path / "out.pth"), fsdp)
    ckpt_dir = tmp_path / "work" / "checkpoints"
    ckpt = load(ckpt_dir / (ckpt_dir / "latest.txt").read_text().strip())  # rank 0 wrote it
    plain = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    plain.load_state_dict({k.removeprefix("net."): v for k, v in ckpt["model"].items()})
    assert_bit_equal(plain.state_dict(), {k.removeprefix("net."): v for k, v in fsdp.items()})
    assert set(ckpt["optimizer"]["state"]) == set(fsdp)  # momentum, keyed by parameter name


@pytest.mark.slow
def test_fsdp2_with_gradient_accumulation_trains_as_ddp_does(tmp_path):
    # FSDP2 reduces gradients on the last micro-batch only, as DDP does under no_sync
    for shard in (0, 1):
        code, err = torchrun(
            tmp_path / f"w{shard}", tmp_path / f"{shard}.pth", SHARD=shard, ACCUM=2
        )
        assert code == 0, failure_output(err)
    fsdp, ddp = load(tmp_path / "1.pth"), load(tmp_path / "0.pth")
    for name in fsdp:
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_fsdp2_sigkill_then_rerun_is_bit_exact(tmp_path, fsdp_run):
    work, out = tmp_path / "work", tmp_path / "out.pth"
    # killed once iteration 6's checkpoint is on disk: the rerun resumes from it, however long
    # the background write took (on a busy machine, more than the two iterations before the kill)
    code, _ = torchrun(work, out, SHARD=1, CLIP=0.05, KILL_AT_ITER=7, KILL_WHEN_SAVED=1)
    assert code != 0 and not out.exists()
    code, err = torchrun(work, out, SHARD=1, CLIP=0.05)
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err and "after iteration 6" in err
    assert_bit_equal(load(out), load(fsdp_run / "out.pth"))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rank 1", "torchrun"])
def test_sigterm_stops_every_rank_at_one_checkpoint(tmp_path, torchrun_reference, target):
    """SIGTERM to one rank, or to torchrun (which forwards it to every rank): the ranks agree at
    a check (every 2 iterations here), save one checkpoint and all exit; the log period (longer
    than the run here) plays no part."""
    work, out = tmp_path / "cut", tmp_path / "cut.pth"
    proc = start_torchrun(
        work, out, SLOW=0.2, CKPT_PERIOD=1000, LOG_PERIOD=1000, PREEMPT_CHECK=2, PID_DIR=tmp_path
    )
    wait_for_training(work, proc)
    time.sleep(0.3)
    if target == "torchrun":
        proc.send_signal(signal.SIGTERM)
    else:
        os.kill(int((tmp_path / "pid_1").read_text()), signal.SIGTERM)
    _, err = communicate(proc, timeout=90)
    assert proc.returncode != 0 and not out.exists()
    stops = [
        re.search(r"Preempted by SIGTERM after iteration (\d+)", (work / log).read_text())
        for log in ("log.txt", "log_rank1.txt")
    ]
    assert stops[0] and stops[1], failure_output(err)
    n = int(stops[0].group(1))
    assert int(stops[1].group(1)) == n and n % 2 == 0  # both, at a check (every 2 iterations)
    assert n < 15  # before the end of the run
    assert sorted(os.listdir(work / "checkpoints")) == [f"iter_{n}.pth", "latest.txt"]
    code, err = torchrun(work, out)
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err
    assert_bit_equal(load(out), torchrun_reference)


@pytest.mark.slow
def test_sigkill_at_random_moments_until_done(tmp_path, reference):
    rng = random.Random(1234)
    work, out = tmp_path / "work", tmp_path / "out.pth"
    kills = 0
    for _ in range(4):
        # fresh: the moments below count on an interpreter's start-up
        proc = start(work, out, fresh=True, SLOW=0.03, CKPT_PERIOD=2)
        time.sleep(rng.uniform(1.0, 4.0))  # start-up takes ~1-3 s, training ~1 s more
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.communicate(timeout=60)
    code, err = run(work, out, CKPT_PERIOD=2)
    assert code == 0, failure_output(err)
    assert kills > 0
    assert_bit_equal(load(out), reference())


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRIED_DRIVER = """
import os, signal, sys
import torch
from trainer import HookBase

class KillAt(HookBase):  # SIGKILL once the checkpoint in flight is on disk, as a crash would
    def after_iter(self):
        if self.trainer.cur_iter == int(os.environ["KILL_AT"]):
            self.trainer.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)

namespace = {"__name__": "__main__"}
exec(open("block.py").read(), namespace)  # the docs' block, less its trainer.train()
namespace["trainer"].register_hook(KillAt())
namespace["trainer"].train()
torch.save(namespace["model"].state_dict(), "out.pth")
"""


def docs_block(page, containing):
    """The ```python block of ``docs/page`` that holds ``containing``."""
    with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as f:
        found = re.findall(r"^```python\n(.*?)^```", f.read(), re.MULTILINE | re.DOTALL)
    (block,) = [code for code in found if containing in code]
    return block


@pytest.mark.slow
def test_carried_state_resumes_exactly_when_registered_and_not_otherwise(tmp_path):
    """docs/loop.md's truncated BPTT, SIGKILLed in its second epoch and rerun: with the LSTM's
    hidden state registered it ends with an uninterrupted run's weights, bit for bit; without,
    the rerun starts the state at zeros and ends elsewhere, which is what the page warns of."""
    block = docs_block("loop.md", "class Carried")
    register = 'trainer.checkpointer.register("carried", model.carried)'
    assert block.endswith("trainer.train()\n") and register in block
    block = block[: -len("trainer.train()\n")]

    def train(name, code, kill_at=-1):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "block.py").write_text(code)
        (folder / "driver.py").write_text(CARRIED_DRIVER)
        env = cpu_env(KILL_AT=str(kill_at), OMP_NUM_THREADS="1")
        proc = popen(
            [sys.executable, "driver.py"], cwd=folder, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _, stderr = communicate(proc, timeout=60)
        return proc.returncode, stderr

    def killed_and_rerun(name, code):
        code_, _ = train(name, code, kill_at=14)  # iteration 15 of 20, epochs of 10
        assert code_ == -signal.SIGKILL
        code_, err = train(name, code)
        assert code_ == 0, failure_output(err)
        assert "Resumed from checkpoint" in err and "epoch_1.pth after iteration 10" in err
        return load(tmp_path / name / "out.pth")

    code, err = train("full", block)
    assert code == 0, failure_output(err)
    full = load(tmp_path / "full" / "out.pth")
    assert_bit_equal(killed_and_rerun("registered", block), full)
    saved = load(tmp_path / "registered" / "tbptt_run" / "checkpoints" / "epoch_1.pth")
    assert [h.shape for h in saved["carried"]["hidden"]] == [(1, 4, 16)] * 2  # weights_only
    unregistered = killed_and_rerun("unregistered", block.replace(register, ""))
    assert max((full[k] - unregistered[k]).abs().max() for k in full) > 1e-4


def wait_for_training(work, proc, timeout=60):
    log = work / "log.txt"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if log.exists() and "Start training" in log.read_text():
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise TimeoutError("the worker never started training")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_exits_and_resumes_exactly(tmp_path, reference, sig):
    work, out = tmp_path / "work", tmp_path / "out.pth"
    proc = start(work, out, SLOW=0.05, CKPT_PERIOD=1000)
    wait_for_training(work, proc)
    time.sleep(0.3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, failure_output(err)
    name = signal.Signals(sig).name
    assert f"Preempted by {name} after iteration" in err
    assert "Rerun the same command to resume" in err
    code, err = run(work, out, CKPT_PERIOD=1000)
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err
    assert_bit_equal(load(out), reference())


@pytest.mark.slow
def test_copies_of_the_signal_never_cut_the_preemption_save_short(tmp_path, reference):
    work, out = tmp_path / "work", tmp_path / "out.pth"
    # Only the preemption save happens (period 1000), and it waits for the test.
    proc = start(work, out, SLOW=0.05, CKPT_PERIOD=1000, HOLD_SAVE="every")
    wait_for_training(work, proc)
    proc.send_signal(signal.SIGTERM)  # twice within microseconds, as srun and torchrun each
    proc.send_signal(signal.SIGTERM)  # pass one on (these two may arrive as one)
    wait_for(work / "holding", proc)
    proc.send_signal(signal.SIGTERM)  # and again while it saves
    (work / "release").touch()
    _, err = communicate(proc, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, failure_output(err)  # exited, not killed
    ignored = r"Preempted by SIGTERM after iteration \d+ \([12] more signals? ignored\)"
    assert re.search(ignored, err), err[-2000:]
    latest = (work / "checkpoints" / "latest.txt").read_text()
    assert latest.startswith("iter_")  # the preemption's checkpoint, on disk
    code, err = run(work, out, CKPT_PERIOD=1000)
    assert code == 0, failure_output(err)
    assert f"Resumed from checkpoint {work / 'checkpoints' / latest}" in err
    assert_bit_equal(load(out), reference())


def wait_for(path, proc, timeout=60):
    """Wait until the worker creates ``path`` (a mark of where it is), failing if it exits."""
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path.name} never came"
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)


def named_checkpoints(log):
    """What a log names as the last checkpoint: the summary's row and the Ctrl-C line's."""
    return re.findall(r"^last checkpoint +(\S+)$", log, re.MULTILINE) + re.findall(
        r"Rerun to resume from the last checkpoint \((.+?)\)\.$", log, re.MULTILINE
    )


def ctrl_c_during_the_last_write(work, out, again=None, **env):
    """Run the worker (3 epochs, a checkpoint each) and press Ctrl-C once its last checkpoint's
    write has begun, which waits for the test; ``again``: a second Ctrl-C, right after the first
    (as a launcher passes it on) or once the first was handled. Returns the exit status and the
    output."""
    proc = start(work, out, CKPT_PERIOD=10, HOLD_SAVE=30, MARK_CTRL_C=1, **env)
    wait_for(work / "holding", proc)  # epoch_3.pth is being written
    proc.send_signal(signal.SIGINT)
    if again == "at once":
        proc.send_signal(signal.SIGINT)
    wait_for(work / "ctrl_c_1", proc)  # the trainer has it
    if again == "later":
        proc.send_signal(signal.SIGINT)
        wait_for(work / "ctrl_c_2", proc)
    (work / "release").touch()
    _, err = communicate(proc, timeout=60)
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "sharded, again", [(False, None), (True, None), (False, "at once"), (True, "later")]
)
def test_ctrl_c_during_the_last_checkpoint_write_lets_it_land_and_exits_130(
    tmp_path, reference, sharded, again
):
    work, out = tmp_path / "work", tmp_path / "out.pth"
    code, err = ctrl_c_during_the_last_write(work, out, again, SHARDED_CKPT=int(sharded))
    assert code == 128 + signal.SIGINT, failure_output(err)
    ckpt = work / "checkpoints"
    # (two signals sent at once may arrive as one)
    more = {None: "", "at once": "(, 1 more ignored)?", "later": ", 1 more ignored"}[again]
    line = (
        rf"Interrupted \(Ctrl-C{more}\) as training ended, after iteration 30 of 30\. Rerun to "
        rf"resume from the last checkpoint \({re.escape(str(ckpt / 'epoch_3.pth'))}\)\.$"
    )
    assert err.count("Interrupted (Ctrl-C") == 1 and re.search(line, err.rstrip()), err[-2000:]
    assert "Traceback" not in err and not out.exists()
    assert sorted(os.listdir(ckpt)) == ["epoch_1.pth", "epoch_2.pth", "epoch_3.pth", "latest.txt"]
    assert (ckpt / "latest.txt").read_text() == "epoch_3.pth"
    log = (work / "log.txt").read_text()
    assert named_checkpoints(log) == [str(ckpt / "epoch_3.pth")] * 2  # the summary, the line
    code, err = run(work, out, CKPT_PERIOD=10, SHARDED_CKPT=int(sharded))
    assert code == 0, failure_output(err)
    assert "Nothing to train" in err  # the interrupted run was complete
    assert_bit_equal(load(out), reference())


@pytest.mark.slow
def test_a_third_ctrl_c_while_the_last_write_hangs_exits_at_once_and_keeps_the_last_checkpoint(
    tmp_path,
):
    work, out = tmp_path / "work", tmp_path / "out.pth"
    # epoch_3.pth's write hangs (as on dead ranks) until the test releases it: it never does
    proc = start(work, out, CKPT_PERIOD=10, HOLD_SAVE=30, MARK_CTRL_C=1)
    try:
        wait_for(work / "holding", proc)
        for press in (1, 2):  # the second is ignored (a launcher's copy), and the write waits
            proc.send_signal(signal.SIGINT)
            wait_for(work / f"ctrl_c_{press}", proc)
        proc.send_signal(signal.SIGINT)
        _, err = communicate(proc, timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, failure_output(err)
    assert "Interrupted (Ctrl-C 3 times): exiting now" in err and "Traceback" not in err
    ckpt = work / "checkpoints"
    assert (ckpt / "latest.txt").read_text() == "epoch_2.pth"  # the write abandoned
    assert not (ckpt / "epoch_3.pth").exists() and not out.exists()
    torch.load(ckpt / "epoch_2.pth", weights_only=True)  # intact


# ---- in one process ---------------------------------------------------------------------------


def checkpoints(trainer):
    return sorted(os.listdir(trainer.ckpt_dir))


def uninterrupted(tmp_path, **kwargs):
    trainer = build(tmp_path / "uninterrupted", **kwargs)
    trainer.train()
    return trainer.model.state_dict()


def corrupt(path, how):
    data = path.read_bytes()
    if how == "flip":  # 100 bytes inside, as a disk or a network might change them
        middle = len(data) // 2
        changed = bytes(b ^ 0xFF for b in data[middle : middle + 100])
        path.write_bytes(data[:middle] + changed + data[middle + 100 :])
    else:
        path.write_bytes(data[: len(data) // 2] if how == "truncate" else b"\x00garbage" * 100)


@pytest.mark.parametrize("how", ["truncate", "garbage", "flip"])
def test_auto_resume_falls_back_to_the_newest_checkpoint_that_loads(tmp_path, caplog, how):
    build(tmp_path, max_epochs=3).train()
    corrupt(tmp_path / "checkpoints" / "epoch_3.pth", how)
    trainer = build(tmp_path, max_epochs=4)
    trainer.train()
    assert trainer.start_iter == 16  # from epoch_2.pth
    assert "epoch_3.pth' is damaged" in caplog.text
    assert "Resuming from" in caplog.text and "the newest checkpoint that loads" in caplog.text
    assert_bit_equal(trainer.model.state_dict(), uninterrupted(tmp_path, max_epochs=4))


def test_replacing_a_checkpoint_that_did_not_load_is_said(tmp_path, caplog):
    build(tmp_path, max_epochs=3).train()
    damaged = tmp_path / "checkpoints" / "epoch_3.pth"
    corrupt(damaged, "truncate")
    caplog.clear()
    build(tmp_path, max_epochs=4).train()  # from epoch_2.pth, then saves epoch_3.pth again
    said = [r.getMessage() for r in caplog.records if "Replacing" in r.getMessage()]
    assert said == [f"Replacing {damaged}, which did not load when this run resumed."]
    messages = [r.getMessage() for r in caplog.records]
    assert messages.index(said[0]) + 1 == messages.index(
        f"Writing checkpoint {damaged} (after iteration 24) in the background."
    )
    assert load(damaged)["progress"]["iters_done"] == 24


def test_never_starts_from_scratch_while_checkpoints_exist(tmp_path):
    build(tmp_path, max_epochs=2).train()
    for name in ("epoch_1.pth", "epoch_2.pth"):
        corrupt(tmp_path / "checkpoints" / name, "truncate")
    with pytest.raises(RuntimeError, match="No checkpoint in .* loads"):
        build(tmp_path, max_epochs=3).train()


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/trainer-payload-ran",))


def test_a_checkpoint_carrying_code_is_skipped_and_never_runs(tmp_path, caplog):
    marker = "/tmp/trainer-payload-ran"
    if os.path.exists(marker):
        os.remove(marker)
    build(tmp_path, max_epochs=1).train()
    evil = tmp_path / "checkpoints" / "epoch_9.pth"
    save_checkpoint_file({"model": Payload()}, evil)  # its CRCs hold: the code is caught
    (tmp_path / "checkpoints" / "latest.txt").write_text("epoch_9.pth")
    trainer = build(tmp_path, max_epochs=2)
    trainer.train()
    assert not os.path.exists(marker)
    assert trainer.start_iter == 8  # epoch_1.pth
    assert "epoch_9.pth' could not be loaded safely" in caplog.text
    assert_bit_equal(trainer.model.state_dict(), uninterrupted(tmp_path, max_epochs=2))


def test_disk_full_names_the_path_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    build(tmp_path, max_epochs=1).train()
    before = (tmp_path / "checkpoints" / "epoch_1.pth").read_bytes()

    def full_disk(obj, f, *args, **kwargs):  # what torch.save raises when the disk is full
        f.write(b"partial")
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904 (torch chains it so)

    trainer = build(tmp_path, max_epochs=2)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"Could not write .*epoch_2.pth: No space left on device"):
        trainer.train()
    monkeypatch.undo()
    assert checkpoints(trainer) == ["epoch_1.pth", "latest.txt"]
    assert (tmp_path / "checkpoints" / "latest.txt").read_text() == "epoch_1.pth"
    assert (tmp_path / "checkpoints" / "epoch_1.pth").read_bytes() == before
    rerun = build(tmp_path, max_epochs=2)  # space freed: the rerun continues from epoch_1.pth
    rerun.train()
    assert rerun.start_iter == 8
    assert_bit_equal(rerun.model.state_dict(), uninterrupted(tmp_path, max_epochs=2))


def test_a_failed_write_surfaces_at_the_next_iteration_end_not_the_next_save(tmp_path, monkeypatch):
    def full_disk(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    class WaitForTheWrite(HookBase):  # so that iteration 9 surely ends after the write failed
        def after_iter(self):
            if self.trainer.cur_iter == 9:
                for thread in threading.enumerate():
                    if thread.name == "checkpoint-writer":
                        thread.join(timeout=60)

    trainer = build(tmp_path, max_epochs=3)
    trainer.register_hook(WaitForTheWrite())
    monkeypatch.setattr(torch, "save", full_disk)  # epoch_1.pth, at iteration 7, fails
    with pytest.raises(OSError, match=r"Could not write .*epoch_1\.pth: No space left") as error:
        trainer.train()
    assert error.value.errno == 28
    assert 8 <= trainer.cur_iter <= 9  # the iteration end after the failure, not iteration 15


def test_unwritable_work_dir_fails_at_construction(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match="a_file"):
        build(tmp_path / "a_file" / "work")

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("tempfile.TemporaryFile", read_only)
    with pytest.raises(PermissionError, match="is not writable \\(Read-only file system\\)"):
        build(tmp_path / "work")


def test_stray_temp_files_are_removed(tmp_path):
    build(tmp_path, max_epochs=1).train()
    stray = tmp_path / "checkpoints" / ".epoch_2.pth.abc123.tmp"
    stray.write_bytes(b"half")
    build(tmp_path, max_epochs=2).train()
    assert not stray.exists()


class Wider(TinyModel):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.extra = nn.Linear(2, 1)

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.extra(self.linear(x)), y)


def test_a_mismatched_model_is_refused_with_the_keys(tmp_path):
    build(tmp_path, max_epochs=1).train()
    trainer = build(tmp_path, model=Wider(), max_epochs=2)
    with pytest.raises(RuntimeError) as error:
        trainer.train()
    message = str(error.value)
    assert "does not match the model" in message
    assert "missing from the checkpoint: extra.weight, extra.bias" in message
    assert "shapes differ: linear.weight (1, 4) vs (2, 4), linear.bias (1,) vs (2,)" in message
    # the usual remedies first, fine-tuning last
    remedies = ["new work_dir", "resume=False, strict=False"]
    assert [message.index(r) for r in remedies] == sorted(message.index(r) for r in remedies)


def test_weights_only_non_strict_load_for_fine_tuning(tmp_path, caplog):
    source = build(tmp_path / "pretrained", max_epochs=1)
    source.train()
    path = os.path.join(source.ckpt_dir, "epoch_1.pth")

    class NewHead(TinyModel):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(1, 1)

    target = build(tmp_path / "finetune", model=NewHead(), max_epochs=1)
    head_before = target.model.head.weight.clone()
    assert target.load_checkpoint(path, resume=False, strict=False)
    assert torch.equal(target.model.linear.weight, source.model.linear.weight)
    assert torch.equal(target.model.head.weight, head_before)
    assert "skipped:\n  missing from the checkpoint: head.weight, head.bias" in caplog.text
    assert target.start_iter == 0 and target.lr == 0.1  # the training state is not touched
    target.train()
    assert target.start_iter == 0  # a fresh work_dir: nothing to resume


def test_changed_amp_is_reported_and_changed_accumulation_refused(tmp_path, caplog):
    build(tmp_path, max_epochs=1).train()
    build(tmp_path, max_epochs=2, enable_amp=True).train()
    assert "trained with AMP off, this run uses AMP bfloat16" in caplog.text
    trainer = build(tmp_path, max_epochs=3, accumulation_steps=2, loader=None)
    with pytest.raises(ValueError, match=r"was trained with accumulation_steps=1: resume with it"):
        trainer.train()


def test_iteration_checkpoints_in_epoch_based_training_resume_exactly(tmp_path):
    kwargs = {
        "max_epochs": 3,
        "checkpoint_period": 5,
        "checkpoint_by_epoch": False,
        "max_num_checkpoints": None,
    }
    full = build(tmp_path / "full", **kwargs)
    full.train()
    # saves every 5 iterations; the last, at the end of epoch 3, is named for the epoch
    assert checkpoints(full) == [
        "epoch_3.pth",
        "iter_10.pth",
        "iter_15.pth",
        "iter_20.pth",
        "iter_5.pth",
        "latest.txt",
    ]

    class Crash(HookBase):
        def after_iter(self):
            if self.trainer.cur_iter == 12:
                raise KeyboardInterrupt

    cut = build(tmp_path / "cut", **kwargs)
    cut.register_hook(Crash())
    with pytest.raises(SystemExit):
        cut.train()
    resumed = build(tmp_path / "cut", **kwargs)
    resumed.train()
    assert resumed.start_iter == 10
    assert_bit_equal(full.model.state_dict(), resumed.model.state_dict())


def test_resume_from_a_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        build(tmp_path).train(resume_from_checkpoint=str(tmp_path / "nope.pth"))
