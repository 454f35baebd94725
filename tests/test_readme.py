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
    work = tmp_path / "work_dir" / "quick"  # relative: in the current directory
    assert sorted(os.listdir(work / "checkpoints")) == [
        "epoch_10.pth", "epoch_8.pth", "epoch_9.pth", "latest.txt",
    ]  # fmt: skip
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["iter"] == 320 and "total_loss" in rows[-1]  # after 320 iterations
    assert f"Start training with iteration 1 of 320 in {work}, afresh." in log
    # the summary's paths are absolute, though work_dir was relative
    assert re.search(rf"last checkpoint +{re.escape(str(work))}/checkpoints/epoch_10\.pth\n", log)
    assert re.search(rf"logs +log\.txt, metrics\.jsonl, tb_logs in {re.escape(str(work))}\n", log)
    again = run(script, cwd=tmp_path)
    assert (
        f"Nothing to train: {work} holds a finished run of 10 epochs (320 iterations) "
        f"({work}/checkpoints/epoch_10.pth)."
    ) in again


def test_the_usage_snippet_and_getting_starteds_first_run_share_no_work_dir(tmp_path):
    """Both trained in ./work_dir: the second refused the first's checkpoint ("saved with 32
    iterations per epoch, this trainer has 48")."""
    with open(os.path.join(ROOT, "docs", "getting-started.md"), encoding="utf-8") as f:
        first_run = re.search(r"```python\n(.*?trainer\.train\(\).*?)```", f.read(), re.DOTALL)
    for name, code in (("usage.py", usage_snippet()), ("first_run.py", first_run.group(1))):
        (tmp_path / name).write_text(code)
        log = run(tmp_path / name, cwd=tmp_path)
        assert "afresh." in log, name


def test_readme_gives_the_command_of_a_cpu_build_of_pytorch():
    """It said "install a CPU build of PyTorch first" without a command; a plain pip install
    torch pulls the CUDA build on Linux."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        commands = re.findall(r"```bash\n(.*?)\n```", f.read(), re.DOTALL)
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in commands


def test_the_test_command_is_what_ci_runs():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("Run the tests") :]
    command = re.search(r"```bash\n(.*?)\n```", section, re.DOTALL).group(1)
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert command in f.read().splitlines()


def test_readmes_counts_of_tests_are_what_pytest_collects():
    """README says how many tests run in-process (and need a GPU) and how many are slow: the
    counts pytest collects, so that adding or removing tests keeps README true."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    in_process, gpu = map(int, re.search(
        r"the (\d+) in-process tests \((\d+) of them need a GPU", readme
    ).groups())  # fmt: skip
    slow = int(re.search(r"the (\d+) marked slow", readme).group(1))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
         "-p", "no:cacheprovider", "-m", "not slow"],  # its testpaths: the doctests too
        cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    collected = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", proc.stdout)
    assert (in_process, slow) == (int(collected.group(1)), int(collected.group(3)))
    assert in_process == len(ids)
    assert gpu == len([i for i in ids if i.startswith("tests/test_cuda.py::")])
