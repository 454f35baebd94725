"""Preemption signals: caught while training, agreed across ranks (the torchrun cases, with real
processes, are in test_resume.py)."""

import os
import signal
import sys

import pytest
import torch

from trainer import HookBase
from trainer.preemption import Preemption

from conftest import build


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
