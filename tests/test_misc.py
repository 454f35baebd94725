"""The helpers of trainer/misc.py: argument checks, collect_env, set_random_seed and the
work_dir lock (one live run per work_dir)."""

import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from trainer import HookBase, collect_env, set_random_seed
from trainer.hooks import (
    BestCheckpointHook,
    EarlyStoppingHook,
    EMAHook,
    LoggerHook,
    LRUpdateHook,
    ProgressBarHook,
    WatchdogHook,
)
from trainer.misc import NUMBER, WorkDirLock, check_int, check_type

from conftest import build, communicate, cpu_env, popen


def test_check_int_tells_a_wrong_type_from_a_small_value():
    check_int("n", 0, minimum=0)
    with pytest.raises(TypeError, match=r"^n must be a positive int, got bool True"):
        check_int("n", True, minimum=1)
    with pytest.raises(ValueError, match=r"^n must be an int >= 0 \(0 means never\), got -1"):
        check_int("n", -1, minimum=0, note="0 means never")
    with pytest.raises(ValueError, match=r"^period must be a positive int, got 0"):
        check_int("period", 0, minimum=1)


def test_check_type_lets_a_bool_through_only_where_bool_is_named():
    check_type("x", 1.5, NUMBER, "a number")
    check_type("flag", True, bool, "True or False")
    with pytest.raises(TypeError, match=r"^x must be a number, got bool False"):
        check_type("x", False, NUMBER, "a number")
    with pytest.raises(TypeError, match=r"^decay must be a number in \[0, 1\), got str '0\.9'"):
        check_type("decay", "0.9", NUMBER, "a number in [0, 1)")


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: EMAHook(decay="0.9"), TypeError, "^decay .*got str"),
        (lambda: EarlyStoppingHook(5), TypeError, "^metric .*got int 5"),
        (lambda: BestCheckpointHook(None), TypeError, "^metric .*got NoneType"),
        (lambda: EarlyStoppingHook("acc", min_delta="0"), TypeError, "^min_delta .*got str"),
        (lambda: ProgressBarHook(interval="1"), TypeError, "^interval .*got str"),
        (lambda: ProgressBarHook(interval=0), ValueError, "^interval .*got 0"),
        (lambda: WatchdogHook(factor="10"), TypeError, "^factor .*got str"),
        (lambda: WatchdogHook(min_seconds=None), TypeError, "^min_seconds .*got NoneType"),
        (lambda: LRUpdateHook(plateau_metric=1), TypeError, "^plateau_metric .*got int"),
        (lambda: LoggerHook(writers=[print]), TypeError, "^writers "),
    ],
)
def test_hook_arguments_of_the_wrong_type_or_range_are_named(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_collect_env_is_a_table_with_versions():
    table = collect_env()
    assert torch.__version__ in table
    assert "CUDA available" in table and "numpy" in table


def draw():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_set_random_seed_makes_runs_repeat():
    assert set_random_seed(7) == 7
    first = draw()
    set_random_seed(7)
    assert draw() == first
    assert isinstance(set_random_seed(None), int)


@pytest.mark.parametrize("seed", [None, -1, -5])
def test_no_seed_or_a_negative_one_picks_a_random_seed_logs_and_returns_it(seed, caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    used = set_random_seed(seed)
    assert 0 <= used < 2**31 and torch.initial_seed() == used
    assert f"Using a random seed: {used}" in caplog.text
    first = draw()
    set_random_seed(used)  # the logged seed repeats the run
    assert draw() == first


@pytest.mark.slow
def test_a_picked_seed_is_shown_before_logging_is_set_up_and_run_json_keeps_it(tmp_path):
    script = (
        "import torch\n"
        "from trainer import Trainer, set_random_seed\n"
        "seed = set_random_seed(-1)\n"
        "model = torch.nn.Linear(2, 1)\n"
        "trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None,\n"
        f"                  [torch.zeros(2)], max_epochs=1, work_dir={str(tmp_path)!r})\n"
        "print(seed, trainer.run_config['seed'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seed, recorded = proc.stdout.split()
    assert seed == recorded and f"Using a random seed: {seed}" in proc.stderr


@pytest.mark.parametrize(
    "seed, error, message",
    [
        ("1", TypeError, "seed must be an int or None, got str '1'"),
        (1.5, TypeError, "got float 1.5"),
        (True, TypeError, "got bool True"),
        (2**32, ValueError, "2**32"),  # NumPy's own error
    ],
)
def test_a_seed_of_another_type_or_too_large_is_refused(seed, error, message):
    with pytest.raises(error, match=re.escape(message)):
        set_random_seed(seed)
    assert set_random_seed(np.int64(7)) == 7


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
    assert first.cur_iter == 15 and sorted(os.listdir(first.ckpt_dir)) == [
        "epoch_1.pth",
        "epoch_2.pth",
        "latest.txt",
    ]
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
    proc = popen(
        [sys.executable, str(script)],
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
