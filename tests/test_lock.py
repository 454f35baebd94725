"""One live run per work_dir (trainer/lock.py)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from trainer import HookBase
from trainer.lock import WorkDirLock

from conftest import build, communicate, cpu_env


class SecondRunInside(HookBase):
    """At iteration 3 of a run, starts a second run in the same work_dir."""

    def __init__(self, make):
        self.make, self.error = make, None

    def after_iter(self):
        if self.trainer.cur_iter == 3:
            with pytest.raises(RuntimeError) as e:
                self.make().train()
            self.error = str(e.value)


def test_a_second_run_in_a_live_work_dir_is_refused_naming_the_folder_and_process(tmp_path):
    first = build(tmp_path / "work")
    second = SecondRunInside(lambda: build(tmp_path / "work", max_epochs=3))
    first.register_hook(second)
    first.train()  # untouched by the refused run
    assert second.error.startswith(
        f"{tmp_path / 'work'} is in use by another run (pid {os.getpid()}"
    )
    assert "would resume each other's checkpoints and mix their logs" in second.error
    assert first.cur_iter == 15 and sorted(os.listdir(first.ckpt_dir)) == [
        "epoch_1.pth", "epoch_2.pth", "latest.txt",
    ]  # fmt: skip
    build(tmp_path / "work", max_epochs=3).train()  # once it has ended, the folder is free


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from conftest import build
from trainer import HookBase

class Kill(HookBase):
    def after_iter(self):
        if self.trainer.cur_iter == 5:
            os.kill(os.getpid(), signal.SIGKILL)

trainer = build({work!r})
trainer.register_hook(Kill())
trainer.train()
"""


@pytest.mark.slow
def test_a_run_killed_with_sigkill_leaves_no_lock(tmp_path):
    script = tmp_path / "killed.py"
    tests = os.path.dirname(__file__)
    script.write_text(textwrap.dedent(KILLED.format(tests=tests, work=str(tmp_path / "work"))))
    proc = subprocess.Popen([sys.executable, str(script)], env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    communicate(proc, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.exists(tmp_path / "work" / ".lock")  # the file stays, its lock does not
    rerun = build(tmp_path / "work")
    rerun.train()
    assert rerun.cur_iter == 15


def test_the_lock_names_its_holder_and_frees_the_folder_when_released(tmp_path):
    first, second = WorkDirLock(str(tmp_path)), WorkDirLock(str(tmp_path))
    with first.held():
        assert first.problem is None
        with second.held():
            assert "is in use by another run (pid" in second.problem
    with second.held():
        assert second.problem is None
