"""The test harness itself: a subprocess that hangs fails its test with every process's stack."""

import os
import subprocess
import time

import pytest

from conftest import communicate, cpu_env, popen, torchrun_command

HANG = """import os, pathlib, time

def wait_forever():
    pathlib.Path(os.environ["READY_DIR"], os.environ["RANK"]).touch()
    time.sleep(600)

wait_forever()
"""


@pytest.mark.slow
def test_a_hung_torchrun_fails_with_the_stack_of_every_worker(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    cmd = torchrun_command("--nproc_per_node", "2", str(script))
    env = cpu_env(READY_DIR=str(tmp_path))
    proc = popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (os.path.exists(tmp_path / "0") and os.path.exists(tmp_path / "1")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    with pytest.raises(pytest.fail.Exception, match="did not end within 1 s") as failure:
        communicate(proc, timeout=1)
    assert str(failure.value).count("in wait_forever") == 2  # one stack per rank
    assert proc.poll() is not None


def test_a_test_not_marked_slow_cannot_start_a_process():
    # conftest's pytest_runtest_protocol: pytest -m "not slow" starts no process
    with pytest.raises(pytest.fail.Exception, match=r"starts a process \(\['true'\]\): mark it"):
        subprocess.run(["true"])
