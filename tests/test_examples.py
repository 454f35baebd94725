"""The examples run as the README says, and the digits one reaches 95% test accuracy."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("sklearn", reason="the examples extra (scikit-learn) is not installed")


def run(cmd, cwd, timeout=240):
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


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


def test_custom_hook_example(tmp_path):
    script = os.path.join(ROOT, "examples", "custom_hook.py")
    output = run([sys.executable, script], cwd=tmp_path)
    hits = int(re.search(r"log points under the threshold: (\d+)", output).group(1))
    assert hits > 0
