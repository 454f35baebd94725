"""The examples run as the README says, and the digits one reaches 95% test accuracy."""

import os
import re
import socket
import subprocess
import sys
from subprocess import PIPE

import pytest
import torch

from conftest import communicate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("sklearn", reason="the examples extra (scikit-learn) is not installed")


def run(cmd, cwd, timeout=180):
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=PIPE, stderr=PIPE, text=True)
    stdout, stderr = communicate(proc, timeout)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout + stderr


def final_accuracy(output):
    return float(re.search(r"Final test accuracy: ([\d.]+)", output).group(1))


def test_train_digits_reaches_95_percent(tmp_path):
    script = os.path.join(ROOT, "examples", "train_digits.py")
    output = run([sys.executable, script, "--work-dir", str(tmp_path)], cwd=tmp_path)
    assert final_accuracy(output) >= 0.95
    assert os.path.isfile(tmp_path / "checkpoints" / "epoch_15.pth")
    # rerunning resumes the finished run instead of training again
    again = run([sys.executable, script, "--work-dir", str(tmp_path)], cwd=tmp_path)
    assert "Start training from iteration 675 of 675" in again
    assert final_accuracy(again) == final_accuracy(output)


def test_train_digits_under_torchrun_with_two_processes(tmp_path):
    script = os.path.join(ROOT, "examples", "train_digits.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script]
    output = run(cmd + ["--work-dir", str(tmp_path)], cwd=tmp_path)
    assert "world size 2" in output
    assert final_accuracy(output) >= 0.95
    assert (tmp_path / "log_rank1.txt").is_file()
    # rank 0 alone writes checkpoints and TensorBoard files
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "epoch_14.pth", "epoch_15.pth", "latest.txt"
    ]  # fmt: skip


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_train_digits_as_two_torchrun_nodes_on_localhost(tmp_path):
    """Two one-process "nodes" meeting at a c10d rendezvous train exactly as one two-process
    node does."""
    script = os.path.join(ROOT, "examples", "train_digits.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    args = [script, "--epochs", "2"]
    run(torchrun + ["--nproc_per_node", "2"] + args + ["--work-dir", "one"], cwd=tmp_path)
    rdzv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d"]
    rdzv += ["--rdzv-endpoint", f"localhost:{free_port()}", "--rdzv-id", "digits"]
    # torchrun gives one-process nodes all CPU threads: one each, as on the single node
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
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
