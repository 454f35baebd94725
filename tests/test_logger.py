import logging
import os
import subprocess
import sys
import types

import pytest

from trainer import setup_logger
from trainer.logger import log_file_path, log_to_file

from conftest import cpu_env


def test_setup_logger_is_idempotent_and_writes_files(tmp_path):
    log = setup_logger("trainer_test_a", output=str(tmp_path))
    setup_logger("trainer_test_a", output=str(tmp_path))
    assert len(log.handlers) == 2  # one console, one file
    log.info("hello file")
    for h in log.handlers:
        h.flush()
    assert "hello file" in (tmp_path / "log.txt").read_text()


def test_other_ranks_get_their_own_file_and_no_console(tmp_path):
    log = setup_logger("trainer_test_b", output=str(tmp_path / "run.log"), rank=1)
    assert [isinstance(h, logging.FileHandler) for h in log.handlers] == [True]
    assert log_file_path(str(tmp_path / "run.log"), 1).endswith("run_rank1.log")


def test_a_log_folder_in_the_home_folder_is_written_there(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert log_file_path("~/runs/x") == str(tmp_path / "runs" / "x" / "log.txt")
    assert log_file_path("~/runs/x.log", 1) == str(tmp_path / "runs" / "x_rank1.log")


def test_log_to_file_detaches_and_closes(tmp_path):
    path = str(tmp_path / "x.txt")
    with log_to_file("trainer_test_c", path):
        logging.getLogger("trainer_test_c.child").warning("inside")
    logging.getLogger("trainer_test_c.child").warning("outside")
    text = (tmp_path / "x.txt").read_text()
    assert "inside" in text and "outside" not in text
    assert logging.getLogger("trainer_test_c").handlers == []


def test_ensure_console_logging_defers_to_configured_logging(monkeypatch):
    from trainer.logger import ensure_console_logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    ensure_console_logging("trainer_test_d", rank=0)
    log = logging.getLogger("trainer_test_d")
    assert log.level == logging.INFO and len(log.handlers) == 1 and log.propagate
    ensure_console_logging("trainer_test_d", rank=0)
    assert len(log.handlers) == 1
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    ensure_console_logging("trainer_test_e", rank=0)  # the program configured logging itself
    assert logging.getLogger("trainer_test_e").handlers == []


FAILING_RUN = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import build
from trainer import HookBase

class Fail(HookBase):
    def after_iter(self):
        if self.trainer.cur_iter == 5:
            raise ValueError("injected failure")

trainer = build({work!r}, max_epochs=1)
trainer.register_hook(Fail())
trainer.train()
"""


@pytest.mark.slow
def test_a_training_error_prints_its_traceback_once_and_keeps_it_in_the_log_file(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RUN.format(tests=tests, work=str(tmp_path / "work")))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=cpu_env(), timeout=120
    )
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr
    assert proc.stderr.rstrip().endswith("ValueError: injected failure")
    assert (
        "Training failed in iteration 6 of 8 (last checkpoint on disk: none): ValueError: "
        "injected failure"
    ) in proc.stderr
    log = (tmp_path / "work" / "log.txt").read_text()
    assert log.count("Traceback (most recent call last)") == 1
    assert 'raise ValueError("injected failure")' in log


def test_a_folder_named_like_a_log_file_is_a_folder(tmp_path):
    (tmp_path / "exp1.log").mkdir()
    assert log_file_path(str(tmp_path / "exp1.log")) == str(tmp_path / "exp1.log" / "log.txt")
    assert log_file_path(str(tmp_path / "new.log")) == str(tmp_path / "new.log")


def test_log_files_are_not_written_through_a_symbolic_link(tmp_path):
    target = tmp_path / "elsewhere.txt"
    (tmp_path / "log.txt").symlink_to(target)
    with pytest.raises(RuntimeError, match="log.txt is a symbolic link"):
        with log_to_file("trainer_test_link", str(tmp_path / "log.txt")):
            pass
    assert not target.exists()


def test_setup_logger_and_the_console_checks_live_in_the_logger_module():
    import trainer
    from trainer.logger import draws_safely_on, in_notebook, setup_logger

    assert setup_logger is trainer.setup_logger  # core-pytorch-utils' cpu.logger path
    assert {in_notebook.__module__, draws_safely_on.__module__} == {"trainer.logger"}


class ZMQInteractiveShell:
    """IPython's shell in a Jupyter kernel (ipykernel's), by its name."""


class Shell(ZMQInteractiveShell):
    """Colab's kernel shell: a subclass."""


class DatabricksShell:
    """A kernel's shell of its own, known by the kernel app in its config."""

    config = {"IPKernelApp": {"connection_file": "kernel.json"}}


class TerminalInteractiveShell:
    """IPython in a terminal: no notebook (the console prints the log points' lines)."""

    config = {"TerminalIPythonApp": {"display_banner": False}}


@pytest.mark.parametrize(
    "shell, notebook",
    [
        (ZMQInteractiveShell(), True),
        (Shell(), True),
        (DatabricksShell(), True),
        (TerminalInteractiveShell(), False),
        (None, False),  # plain Python, IPython imported
    ],
)
def test_a_notebook_is_a_kernels_shell_of_any_class(monkeypatch, shell, notebook):
    from trainer.logger import in_notebook

    ipython = types.SimpleNamespace(get_ipython=lambda: shell)
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    assert in_notebook() is notebook
