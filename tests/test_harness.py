"""The test harness itself: a subprocess that hangs fails its test with every process's stack;
processes differ in hash seed as fresh interpreters do, and a failure says how to replay them."""

import os
import re
import subprocess
import sys
import time

import pytest

import conftest
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


SEED = """import os
print(os.environ.get("RANK", "script"), hash("a str"))
"""


@pytest.mark.slow
def test_processes_differ_in_hash_seed_from_the_one_before_and_those_beside(tmp_path):
    # so the order of a set of strings differs too, and a bug that needs it to can show
    script = tmp_path / "seed.py"
    script.write_text(SEED)

    def hashes(cmd) -> dict[str, str]:
        proc = popen(cmd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = communicate(proc, timeout=120)
        assert proc.returncode == 0, err[-3000:]
        return dict(line.split() for line in out.splitlines())

    first = hashes([sys.executable, str(script)])
    assert hashes([sys.executable, str(script)])["script"] != first["script"]
    ranks = hashes(torchrun_command("--nproc_per_node", "2", str(script)))
    assert ranks["0"] != ranks["1"]
    if os.environ.get("TRAINER_TEST_FORKSERVER") != "0":
        # the launcher's seed differs from its workers'; a failure's report lists every seed
        report = conftest.forked_processes("test_x").splitlines()
        launch = [re.fullmatch(r"pid \d+, hash seed (\d+): python (.*)", x) for x in report[2:5]]
        assert "torch.distributed.run" in launch[0][2] and len({m[1] for m in launch}) == 3
        assert report[5].startswith("The same seeds in the same order: TRAINER_TEST_HASHSEEDS=")
        assert report[5].endswith(" pytest -n 0 'test_x'")
