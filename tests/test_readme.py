"""README's Usage snippet runs as it stands, and reruns as README says."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import communicate, cpu_env, popen

pytestmark = pytest.mark.slow  # runs the snippet as a script, twice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def usage_snippet():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    usage = readme[readme.index("\n## Usage\n") :]
    return re.search(r"```python\n(.*?)```", usage, re.DOTALL).group(1)


def run(script, cwd):
    proc = popen(
        [sys.executable, str(script)], cwd=cwd, env=cpu_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stdout, stderr = communicate(proc, timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout + stderr


def test_the_usage_snippet_trains_in_work_dir_and_a_rerun_says_it_is_finished(tmp_path):
    script = tmp_path / "usage.py"
    script.write_text(usage_snippet())
    log = run(script, cwd=tmp_path)
    work = tmp_path / "work_dir"  # relative: in the current directory
    assert sorted(os.listdir(work / "checkpoints")) == [
        "epoch_10.pth", "epoch_8.pth", "epoch_9.pth", "latest.txt",
    ]  # fmt: skip
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["iter"] == 319 and "total_loss" in rows[-1]
    assert f"Start training from iteration 0 of 320 in {work}, afresh." in log
    # the summary's paths are absolute, though work_dir was relative
    assert re.search(rf"last checkpoint +{re.escape(str(work))}/checkpoints/epoch_10\.pth\n", log)
    assert re.search(rf"logs +log\.txt, metrics\.jsonl, tb_logs in {re.escape(str(work))}\n", log)
    again = run(script, cwd=tmp_path)
    assert f"Nothing to train: the run in {work} is finished" in again
    assert "pass train(auto_resume=False) or another work_dir" in again


def test_the_test_command_is_what_ci_runs():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("Run the tests") :]
    command = re.search(r"```bash\n(.*?)\n```", section, re.DOTALL).group(1)
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert command in f.read().splitlines()
