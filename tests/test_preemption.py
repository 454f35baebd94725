"""Preemption signals: caught while training, agreed across ranks; and Ctrl-C (the torchrun
cases, and Ctrl-C pressed at a real process, are in test_resume.py)."""

import os
import signal
import sys
import threading
import time

import pytest
import torch

from trainer import CheckpointHook, HookBase, Priority
from trainer.checkpoint_io import Background
from trainer.preemption import Interrupt, Preemption
from trainer.progress import Progress

from conftest import build, load


def test_in_one_process_a_signal_stops_after_the_iteration_it_arrived_in():
    preemption = Preemption(check_period=10)
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit) as exit_info:  # the block did not exit for it: leaving does
        with preemption.catching():
            assert preemption.agreed_signal(0) == 0
            os.kill(os.getpid(), signal.SIGUSR1)
            assert preemption.agreed_signal(1) == signal.SIGUSR1  # not only at check periods
    assert exit_info.value.code == 128 + signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before  # the handler is restored
    with preemption.catching():
        assert preemption.agreed_signal(2) == 0  # a new train() starts afresh


def test_preemption_at_an_epochs_last_iteration_resumes_exactly(tmp_path):
    class SigtermAt(HookBase):
        def after_iter(self):
            if self.trainer.cur_iter == 7:  # the last of epoch 0's 8 iterations
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = build(tmp_path, max_epochs=3, checkpoint_period=100)
    trainer.register_hook(SigtermAt())
    with pytest.raises(SystemExit) as exit_info:
        trainer.train()
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert os.path.isfile(tmp_path / "checkpoints" / "iter_8.pth")
    resumed = build(tmp_path, max_epochs=3, checkpoint_period=100)
    resumed.train()
    assert resumed.start_iter == 8
    full = build(tmp_path / "uninterrupted", max_epochs=3, checkpoint_period=100)
    full.train()
    a, b = resumed.model.state_dict(), full.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_signal_in_the_last_iteration_exits_once_training_is_complete(tmp_path):
    class SigtermAt(HookBase):
        def after_iter(self):
            if self.trainer.cur_iter == 15:  # the last iteration: nothing left to save for
                os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    trainer = build(tmp_path, max_epochs=2)
    trainer.register_hook(SigtermAt())
    with pytest.raises(SystemExit) as exit_info:  # not swallowed: the scheduler asked for it
        trainer.train()
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert trainer.cur_iter == 15  # every iteration ran, and the final checkpoint is on disk
    assert (tmp_path / "checkpoints" / "latest.txt").read_text() == "epoch_2.pth"
    assert signal.getsignal(signal.SIGTERM) is before
    rerun = build(tmp_path, max_epochs=2)
    rerun.train()  # nothing left to train, and no signal: a normal return
    assert rerun.start_iter == 16


@pytest.mark.slow  # six runs in one work dir: ~5 s
def test_preemption_checkpoints_count_against_max_num_checkpoints(tmp_path):
    class SigtermAt(HookBase):
        def __init__(self, iteration):
            self.iteration = iteration

        def after_iter(self):
            if self.trainer.cur_iter == self.iteration:
                os.kill(os.getpid(), signal.SIGTERM)

    ckpt_dir = tmp_path / "checkpoints"
    for iteration in (2, 10, 13, 19, 28):  # five preemptions in four epochs of 8 iterations
        trainer = build(tmp_path, max_epochs=4, max_num_checkpoints=2)
        trainer.register_hook(SigtermAt(iteration))
        with pytest.raises(SystemExit):
            trainer.train()
        pths = sorted(p for p in os.listdir(ckpt_dir) if p.endswith(".pth"))
        assert len(pths) <= 3, pths  # the two kept and the preemption's newest, at most
    build(tmp_path, max_epochs=4, max_num_checkpoints=2).train()
    # the newest two: the last preemption's, resumed from, and the final one
    assert sorted(p for p in os.listdir(ckpt_dir) if p.endswith(".pth")) == [
        "epoch_4.pth", "iter_29.pth"
    ]  # fmt: skip


class _NoImports:  # out of file descriptors, no module of ours could be imported
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "trainer":
            raise OSError(24, "Too many open files", name)


@pytest.mark.parametrize("at_iter", [3, 15])  # mid-run (save, then exit), and the last one
def test_a_signal_saves_and_exits_without_importing(tmp_path, monkeypatch, at_iter):
    class SignalWithoutFiles(HookBase):
        def after_iter(self):
            if self.trainer.cur_iter == at_iter:
                sys.meta_path.insert(0, _NoImports())
                os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # restored after the test
    trainer = build(tmp_path, max_epochs=2)
    trainer.register_hook(SignalWithoutFiles())
    with pytest.raises(SystemExit) as exit_info:
        trainer.train()
    trainer.checkpointer.wait()
    assert exit_info.value.code == 128 + signal.SIGUSR1
    saved = "iter_4.pth" if at_iter == 3 else "epoch_2.pth"
    assert (tmp_path / "checkpoints" / "latest.txt").read_text() == saved


# ---- Ctrl-C ----------------------------------------------------------------------------------


def joining(frame):
    """Whether a thread's stack (its innermost ``frame``) is waiting in ``Thread.join``."""
    while frame is not None:
        if frame.f_code is threading.Thread.join.__code__:
            return True
        frame = frame.f_back
    return False


def wait_until(condition, what):
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.001)


def newest(last, done=-1):
    """A stand-in for ``Checkpointer.newest_on_disk``."""
    return lambda: (last, done)


def test_a_ctrl_c_during_a_thread_join_is_put_off_and_the_join_waits_for_the_thread(caplog):
    progress = Progress(epoch_len=8, max_iters=16, iter=4)
    interrupt = Interrupt(progress, newest("last.pth"))
    main = threading.main_thread()

    def write():  # a checkpoint write, during whose join Ctrl-C comes
        wait_until(lambda: joining(sys._current_frames()[main.ident]), "the join")
        signal.pthread_kill(main.ident, signal.SIGINT)
        wait_until(lambda: interrupt.put_off, "the handler")
        written.append(True)

    written = []
    with pytest.raises(SystemExit) as exit_info:
        with interrupt.catching():
            thread = threading.Thread(target=write)
            thread.start()
            thread.join()
    # Raised in join, a KeyboardInterrupt would end the block with the write still running,
    # and mark its thread ended (CPython gh-90882): a later join would not wait for it.
    assert written == [True] and not thread.is_alive()
    assert exit_info.value.code == 128 + signal.SIGINT
    line = (
        "Interrupted (Ctrl-C) in iteration 5 of 16: not saved. Rerun to resume from the last "
        "checkpoint (last.pth)."
    )
    assert [r.getMessage() for r in caplog.records if "Ctrl-C" in r.getMessage()] == [line]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_another_ctrl_c_while_train_ends_is_ignored(monkeypatch, caplog):
    # a launcher (torchrun) passes on the terminal's Ctrl-C, which reaches this process too
    monkeypatch.setattr(os, "_exit", lambda status: pytest.fail("exited at once"))
    progress = Progress(epoch_len=8, max_iters=16, iter=15, position=(2, 0))  # training ended
    interrupt = Interrupt(progress, newest("epoch_2.pth", 16))
    ended = []
    with pytest.raises(SystemExit) as exit_info:
        with interrupt.catching():
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:
                os.kill(os.getpid(), signal.SIGINT)  # again, while train() ends
                ended.append(True)  # (the write in flight lands, the logs close)
    assert ended == [True] and exit_info.value.code == 128 + signal.SIGINT
    line = (
        "Interrupted (Ctrl-C, 1 more ignored) as training ended, after iteration 16 of 16. Rerun "
        "to resume from the last checkpoint (epoch_2.pth)."
    )
    assert [r.getMessage() for r in caplog.records if "Ctrl-C" in r.getMessage()] == [line]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _Exited(BaseException):
    pass


def test_a_third_ctrl_c_exits_at_once_saying_so_on_stderr(monkeypatch, capfd):
    def exit_now(status):
        raise _Exited(status)

    monkeypatch.setattr(os, "_exit", exit_now)
    interrupt = Interrupt(Progress(epoch_len=8, max_iters=16, iter=15), newest("epoch_1.pth"))
    with pytest.raises(_Exited) as exit_info:
        with interrupt.catching():
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:  # train() ends: a hook's after_train hangs, say
                os.kill(os.getpid(), signal.SIGINT)  # ignored, as a launcher's copy
                os.kill(os.getpid(), signal.SIGINT)  # the user, again
                pytest.fail("the third Ctrl-C was ignored")
    assert exit_info.value.args == (128 + signal.SIGINT,)
    err = capfd.readouterr().err
    assert "Interrupted (Ctrl-C 3 times): exiting now" in err and err.endswith("\n")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (catching ended)


def test_a_ctrl_c_after_one_that_code_caught_stops_at_the_iteration_end(tmp_path):
    class CtrlC(HookBase):
        def after_iter(self):
            if self.trainer.cur_iter == 2:
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                except KeyboardInterrupt:  # caught by code the trainer calls
                    pass
            if self.trainer.cur_iter == 5:
                os.kill(os.getpid(), signal.SIGINT)  # ignored as a copy, yet not for nothing
                ran.append(True)

    ran = []
    trainer = build(tmp_path, max_epochs=2)
    trainer.register_hook(CtrlC())
    with pytest.raises(SystemExit) as exit_info:
        trainer.train()
    assert exit_info.value.code == 128 + signal.SIGINT
    assert ran == [True] and trainer.cur_iter == 5  # stopped at the end of that iteration


def test_copies_of_a_preemption_signal_are_ignored_and_counted(caplog):
    preemption = Preemption(check_period=10)
    with pytest.raises(SystemExit) as exit_info:
        with preemption.catching():
            for _ in range(3):  # as srun and torchrun each pass it on, within milliseconds
                os.kill(os.getpid(), signal.SIGTERM)
            assert preemption.agreed_signal(3) == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGUSR1)  # another, while it saves
            preemption.exit(signal.SIGTERM, "iter_4.pth", 4)
    assert exit_info.value.code == 128 + signal.SIGTERM
    line = (
        "Preempted by SIGTERM after iteration 4 (3 more signals ignored): saved iter_4.pth; "
        "exiting with status 143. Rerun the same command to resume."
    )
    assert [r.getMessage() for r in caplog.records if "Preempted" in r.getMessage()] == [line]


def test_a_sigint_handler_of_the_users_is_left_alone(caplog):
    progress = Progress(epoch_len=8, max_iters=16, iter=2)
    interrupt = Interrupt(progress, newest(None))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's
    try:
        with pytest.raises(SystemExit) as exit_info:
            with interrupt.catching():
                assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
                raise KeyboardInterrupt  # raised by code: still one line and status 130
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert exit_info.value.code == 128 + signal.SIGINT
    assert (
        "Interrupted (Ctrl-C) in iteration 3 of 16: not saved. Rerun to resume from the last "
        "checkpoint (none yet: from the start)." in caplog.text
    )


# "main": as a Ctrl-C most often arrives, while the main thread is blocked in the wait, which it
# interrupts. "writer": the signal's C handler runs on the writer's thread and cannot wake the
# main thread's wait, the state that a signal landing just before the wait blocks leaves too
# (CPython's lock wait): there by chance, here every time. While train() waited with one join(),
# the handler then ran only once the write ended, here never (the write waits for the handler):
# "main" failed 23 times in 6,000 runs beside a CPU hog, "writer" 5 times in 5.
@pytest.mark.parametrize("delivered_to", ["main", "writer"])
def test_ctrl_c_while_train_waits_for_the_last_checkpoint_lets_it_land(
    tmp_path, monkeypatch, delivered_to
):
    class MarkCtrlC(HookBase):  # the trainer's handler, then a mark that it ran
        def before_train(self):
            handler = signal.getsignal(signal.SIGINT)

            def marked(signum, frame):
                try:
                    handler(signum, frame)
                finally:
                    handled.set()

            signal.signal(signal.SIGINT, marked)

    handled, main, real_save = threading.Event(), threading.main_thread(), torch.save

    def save(obj, f, *args, **kwargs):  # the last write: Ctrl-C once train() waits for it
        if obj["progress"]["iters_done"] == 16:
            wait_until(lambda: joining(sys._current_frames()[main.ident]), "the wait")
            thread = main.ident if delivered_to == "main" else threading.get_ident()
            signal.pthread_kill(thread, signal.SIGINT)
            wait_until(handled.is_set, "the handler")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    trainer = build(tmp_path, max_epochs=2)
    trainer.register_hook(MarkCtrlC())
    with pytest.raises(SystemExit) as exit_info:
        trainer.train()
    assert exit_info.value.code == 128 + signal.SIGINT
    path = tmp_path / "checkpoints" / "epoch_2.pth"
    saved = load(path)["model"]  # on disk, and the final state
    assert all(torch.equal(v, saved[k]) for k, v in trainer.model.state_dict().items())
    log = (tmp_path / "log.txt").read_text()
    assert f"last checkpoint       {path}\n" in log  # the summary
    line = (
        "Interrupted (Ctrl-C) as training ended, after iteration 16 of 16. Rerun to resume from "
        f"the last checkpoint ({path})."
    )
    assert log.count("Interrupted (Ctrl-C)") == 1 and log.rstrip().endswith(line)
    assert "Traceback" not in log


@pytest.mark.parametrize("write", ["lands at once", "Ctrl-C as it begins"])
def test_the_lines_of_a_save_and_a_ctrl_c_after_it_say_what_happened(tmp_path, monkeypatch, write):
    real_submit = Background.submit

    def submit(self, work):  # the write of iter_10.pth lands before submit() returns, or
        real_submit(self, work)  # Ctrl-C comes as soon as it has begun
        if write == "lands at once":
            self.wait()
        elif trainer.cur_iter == 9:
            os.kill(os.getpid(), signal.SIGINT)

    class CtrlCAfterTheSave(HookBase):  # in the hooks of the iteration saved
        priority = Priority.CHECKPOINT + 1

        def after_iter(self):
            if trainer.cur_iter == 9:
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Background, "submit", submit)
    trainer = build(tmp_path, max_epochs=2, checkpoint_period=0)
    trainer.register_hooks([CheckpointHook(5, by_epoch=False), CtrlCAfterTheSave()])
    with pytest.raises(SystemExit):
        trainer.train()
    log = (tmp_path / "log.txt").read_text()
    for n in (5, 10):  # each write said as it begins, and then once on disk
        path = tmp_path / "checkpoints" / f"iter_{n}.pth"
        writing = log.index(f"Writing checkpoint {path} (after iteration {n})")
        assert writing < log.index(f"Saved checkpoint {path} (on disk)")
    assert "Interrupted (Ctrl-C) after iteration 10 of 16: saved. Rerun to resume from the " in log
    monkeypatch.undo()
    rerun = build(tmp_path, max_epochs=2, checkpoint_period=0)
    rerun.train()
    assert rerun.start_iter == 10  # resumed after iteration 10, as the line said
