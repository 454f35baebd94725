"""The examples run as the README says, and the digits one reaches 95% test accuracy."""

import os
import re
import shutil
import signal
import subprocess
import sys
from subprocess import PIPE

import pytest
import torch

from conftest import communicate, cpu_env, free_port, popen, torchrun_command

pytestmark = pytest.mark.slow  # each runs an example, most under torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("sklearn", reason="the examples extra (scikit-learn) is not installed")


def run(cmd, cwd, timeout=180):
    proc = popen(cmd, cwd=cwd, env=cpu_env(), stdout=PIPE, stderr=PIPE, text=True)
    stdout, stderr = communicate(proc, timeout)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout + stderr


def final_accuracy(output):
    return float(re.search(r"Final test accuracy: ([\d.]+)", output).group(1))


def test_train_digits_reaches_95_percent_and_readmes_commands_pass_after_each_other(tmp_path):
    """README's first command in a copy of the checkout: the example trains into its default
    work_dir/digits there; the docs' tests (part of README's second command, which check that
    nothing writes into the checkout) still pass beside it; rerun, it finds its run finished."""
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(
        ".git", "work_dir*", "site", "build", "*.egg-info", "__pycache__", ".*_cache", ".venv",
    ))  # fmt: skip
    script = os.path.join("examples", "train_digits.py")
    output = run([sys.executable, script], cwd=checkout)
    assert final_accuracy(output) >= 0.95
    # one intra-op thread unless OMP_NUM_THREADS says: two spin-wait beside another busy job
    assert ("One intra-op thread" in output) == ("OMP_NUM_THREADS" not in os.environ)
    assert os.path.isfile(checkout / "work_dir" / "digits" / "checkpoints" / "epoch_15.pth")
    docs = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    assert " passed" in run(docs + ["tests/test_docs.py"], cwd=checkout)  # else run() fails
    # rerunning resumes the finished run instead of training again
    again = run([sys.executable, script], cwd=checkout)
    assert "Nothing to train: " in again and "run of 15 epochs (675 iterations) " in again
    assert final_accuracy(again) == final_accuracy(output)


def test_train_digits_under_torchrun_with_two_processes(tmp_path):
    script = os.path.join(ROOT, "examples", "train_digits.py")
    cmd = torchrun_command("--nproc_per_node", "2", script)
    output = run(cmd + ["--work-dir", str(tmp_path)], cwd=tmp_path)
    assert "world size 2" in output
    assert final_accuracy(output) >= 0.95
    assert (tmp_path / "log_rank1.txt").is_file()
    # rank 0 alone writes checkpoints and TensorBoard files
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "epoch_14.pth", "epoch_15.pth", "latest.txt"
    ]  # fmt: skip
    # the two ranks' evaluation is one process's, of the same weights (the rerun resumes them)
    one = run([sys.executable, script, "--work-dir", str(tmp_path)], cwd=tmp_path)
    assert "Nothing to train" in one and "world size 1" in one
    assert final_accuracy(one) == final_accuracy(output)


def test_train_digits_as_two_torchrun_nodes_on_localhost(tmp_path):
    """Two one-process "nodes" meeting at a c10d rendezvous train exactly as one two-process
    node does."""
    script = os.path.join(ROOT, "examples", "train_digits.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    args = [script, "--epochs", "2"]
    run(torchrun_command("--nproc_per_node", "2", *args, "--work-dir", "one"), cwd=tmp_path)
    rdzv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d"]
    rdzv += ["--rdzv-endpoint", f"localhost:{free_port()}", "--rdzv-id", "digits"]
    # torchrun gives one-process nodes all CPU threads: one each, as on the single node
    env = cpu_env(OMP_NUM_THREADS="1")
    nodes = [
        popen(
            torchrun + rdzv + ["--node_rank", str(n)] + args + ["--work-dir", "two"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for n in (0, 1)
    ]
    outputs = [communicate(node, timeout=90)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert "world size 2" in "".join(outputs)  # from the node that got rank 0
    one, two = (
        torch.load(tmp_path / d / "checkpoints" / "epoch_2.pth", weights_only=True)["model"]
        for d in ("one", "two")
    )
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_custom_hook_example(tmp_path):
    script = os.path.join(ROOT, "examples", "custom_hook.py")
    output = run([sys.executable, script], cwd=tmp_path)
    hits = int(re.search(r"log points under the threshold: (\d+)", output).group(1))
    assert hits > 0


GAN_DRIVER = """
import os, signal, sys
import torch
sys.path.insert(0, sys.argv[1])
import train_gan
from trainer import HookBase

class KillAt(HookBase):  # SIGKILL after this iteration, as a crash would
    def after_iter(self):
        if self.trainer.cur_iter == int(os.environ.get("KILL_AT", -1)):
            os.kill(os.getpid(), signal.SIGKILL)

trainer = train_gan.build_trainer(train_gan.parse_args(sys.argv[3:]))
trainer.register_hook(KillAt())
trainer.train()
torch.save(trainer.model.state_dict(), sys.argv[2])
"""


def test_train_gan_killed_and_rerun_is_bit_exact(tmp_path):
    """The subclassing example: two optimizers, AMP (bfloat16 on CPU), clipping; SIGKILLed in
    mid-epoch and rerun, it ends with the weights of an uninterrupted run, bit for bit."""
    driver = tmp_path / "driver.py"
    driver.write_text(GAN_DRIVER)
    examples = os.path.join(ROOT, "examples")

    def gan(work_dir, out, kill_at=-1):
        cmd = [sys.executable, str(driver), examples, str(out), "--epochs", "4"]
        env = cpu_env(KILL_AT=str(kill_at))
        proc = popen(
            cmd + ["--work-dir", str(work_dir)], cwd=tmp_path, env=env, stdout=PIPE, stderr=PIPE,
            text=True,
        )  # fmt: skip
        _, stderr = communicate(proc, timeout=120)
        return proc.returncode, stderr

    code, err = gan(tmp_path / "full", tmp_path / "full.pth")
    assert code == 0, err[-3000:]
    code, _ = gan(tmp_path / "cut", tmp_path / "cut.pth", kill_at=80)  # epochs of 32 iterations
    assert code == -signal.SIGKILL and not (tmp_path / "cut.pth").exists()
    code, err = gan(tmp_path / "cut", tmp_path / "cut.pth")
    assert code == 0, err[-3000:]
    assert "Resumed from checkpoint" in err and "after iteration 64" in err
    full, cut = (torch.load(tmp_path / f"{n}.pth", weights_only=True) for n in ("full", "cut"))
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    ckpt = torch.load(tmp_path / "cut" / "checkpoints" / "epoch_4.pth", weights_only=True)
    assert ckpt["optimizer_d"]["state"]  # registered by name, beside the trainer's optimizer
    assert ckpt["config"]["amp"] == "bfloat16"


def test_train_gan_under_torchrun(tmp_path):
    script = os.path.join(ROOT, "examples", "train_gan.py")
    cmd = torchrun_command("--nproc_per_node", "2", script)
    output = run(cmd + ["--epochs", "2", "--work-dir", str(tmp_path)], cwd=tmp_path)
    assert re.search(r"Final mode distance: [\d.]+ \(world size 2, AMP bfloat16\)", output)
    assert "d_loss" in (tmp_path / "log.txt").read_text()
