import gc
import io
import os
import sys
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer import HookBase

from conftest import RecordLR, TinyModel, build, load, tiny_dataset, tiny_loader


def weights(trainer):
    return {k: v.clone() for k, v in trainer.model_or_module.state_dict().items()}


def assert_bit_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- the loop -----------------------------------------------------------------------------


def test_epoch_based_training_counts_and_steps(make_trainer):
    trainer = make_trainer(max_epochs=3)
    before = weights(trainer)
    steps = []
    trainer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    trainer.train()
    assert (trainer.epoch_len, trainer.max_iters, trainer.max_epochs) == (8, 24, 3)
    assert (trainer.cur_iter, trainer.cur_epoch, trainer.inner_iter) == (23, 2, 7)
    assert trainer.metric_storage["total_loss"].count == 24
    assert not torch.equal(before["linear.weight"], weights(trainer)["linear.weight"])
    assert len(steps) == 24


def test_iteration_based_training_crosses_passes_and_sets_sampler_epochs(make_trainer):
    events = []

    class Sampler(torch.utils.data.RandomSampler):
        def set_epoch(self, epoch):
            events.append(("set_epoch", epoch))

        def __iter__(self):
            events.append(("iter",))
            return super().__iter__()

    data = tiny_dataset()
    loader = DataLoader(data, batch_size=4, sampler=Sampler(data))
    trainer = make_trainer(loader=loader, max_iters=20)
    trainer.train()
    assert trainer.max_epochs == 3 and trainer.cur_iter == 19
    assert events == [
        ("set_epoch", 0),
        ("iter",),
        ("set_epoch", 1),
        ("iter",),
        ("set_epoch", 2),
        ("iter",),
    ]
    assert trainer.metric_storage["total_loss"].count == 20


def test_unpack_batch_dict(make_trainer):
    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x, y):
            return nn.functional.mse_loss(self.linear(x), y)

    data = [{"x": torch.randn(4), "y": torch.randn(1)} for _ in range(16)]
    trainer = make_trainer(
        model=Keywords(), loader=DataLoader(data, batch_size=4), unpack_batch_dict=True
    )
    trainer.train()
    assert trainer.metric_storage["total_loss"].count == 8


def test_warmup_lr_per_iteration_through_the_trainer(make_trainer):
    trainer = make_trainer(max_iters=6, scheduler=None, warmup_t=4, warmup_init_lr=0.02)
    record = RecordLR()
    trainer.register_hook(record)
    trainer.train()
    assert record.lrs == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1, 0.1])


# ---- no sync in the hot loop --------------------------------------------------------------


def test_iterations_that_do_not_log_make_no_host_reads(make_trainer, monkeypatch):
    counter = {"n": 0, "paused": False}
    for name in ("item", "tolist", "cpu", "__float__", "__bool__", "__int__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counter["n"] += not counter["paused"]
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    reads = {}

    class Snapshot(HookBase):
        priority = 6  # after TimerHook's log point: brackets train_one_iter and the flush

        def before_iter(self):
            self.start = counter["n"]

        def after_iter(self):
            reads[self.trainer.cur_iter] = counter["n"] - self.start

    class UncountedPasses:
        """The loader, except that starting a pass is not counted: the DataLoader draws its seed
        with .item() on a CPU tensor at every new pass, a host read of PyTorch's own, once per
        epoch, with no device involved."""

        def __init__(self, loader):
            self.loader = loader

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            counter["paused"] = True
            try:
                return iter(self.loader)
            finally:
                counter["paused"] = False

    # unshuffled: RandomSampler also reads CPU tensors (seed, randperm) at a pass's first batch
    trainer = make_trainer(
        loader=UncountedPasses(tiny_loader()), max_iters=24, log_period=8, clip_grad_norm=1.0,
        checkpoint_period=100,
    )  # fmt: skip
    trainer.register_hook(Snapshot())
    trainer.train()
    log_iters = {7, 15, 23}
    assert all(reads[i] == 0 for i in range(24) if i not in log_iters), reads
    assert all(reads[i] > 0 for i in log_iters)  # the counter does see the one flush per period


def test_hooks_read_the_metrics_of_the_last_log_point(make_trainer, monkeypatch):
    """Reading metric_storage has no side effect: a hook that reads it after every iteration
    makes no host read and sees the values of the last log point, as under torchrun
    (test_distributed.py::test_logged_metrics_are_reduced_over_ranks_at_log_points). Numbers
    a hook logs are in it at once, as in core-pytorch-utils."""
    reads, seen = [], []
    real_tolist = torch.Tensor.tolist

    def counted(self, *args, **kwargs):
        reads.append(1)
        return real_tolist(self, *args, **kwargs)

    class Reader(HookBase):
        def after_iter(self):
            before = len(reads)
            storage = self.metric_storage
            seen.append(storage["total_loss"].count if "total_loss" in storage else 0)
            assert len(reads) == before
            self.log(self.trainer.cur_iter, seen=float(self.trainer.cur_iter), smooth=False)
            assert self.metric_storage["seen"].latest == self.trainer.cur_iter

    trainer = make_trainer(max_iters=10, log_period=4, checkpoint_period=0)
    trainer.register_hook(Reader())
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    trainer.train()
    assert seen == [0, 0, 0, 4, 4, 4, 4, 8, 8, 10]


def test_epoch_hooks_read_every_loss_of_the_epoch_and_a_failure_keeps_its_losses(make_trainer):
    """An epoch's end flushes what its iterations logged since the last log point (8 iterations
    per epoch, log_period=3); a failed run keeps the losses logged before it failed."""
    latest = []

    class AtEpochEnd(HookBase):
        def after_epoch(self):
            latest.append(self.metric_storage.latest_iter("total_loss"))

    trainer = make_trainer(max_epochs=2, log_period=3, checkpoint_period=0)
    trainer.register_hook(AtEpochEnd())
    trainer.train()
    assert latest == [7, 15]

    class FailAt5(HookBase):
        def after_iter(self):
            if self.trainer.cur_iter == 5:
                raise RuntimeError("fails at iteration 5")

    failing = make_trainer(max_epochs=2, log_period=4, work_dir=trainer.work_dir + "_failing")
    failing.register_hook(FailAt5())
    with pytest.raises(RuntimeError, match="fails at iteration 5"):
        failing.train()
    assert failing.metric_storage["total_loss"].count == 6  # iterations 0 to 5


# ---- non-finite losses --------------------------------------------------------------------


# ---- resume -------------------------------------------------------------------------------


class StopAt(HookBase):
    """Simulates a crash after iteration ``it``."""

    def __init__(self, it):
        self.it = it

    def after_iter(self):
        if self.trainer.cur_iter == self.it:
            raise KeyboardInterrupt("simulated crash")


def train_interrupted(make, crash_iter, **kwargs):
    trainer = make(**kwargs)
    trainer.register_hook(StopAt(crash_iter))
    with pytest.raises(SystemExit):
        trainer.train()
    resumed = make(**kwargs)
    resumed.train()
    return resumed


def test_epoch_based_resume_is_bit_exact(tmp_path):
    kwargs = {"max_epochs": 4, "warmup_t": 5, "warmup_init_lr": 0.01}
    full = build(tmp_path / "full", **kwargs)
    full.train()
    resumed = train_interrupted(lambda **kw: build(tmp_path / "cut", **kw), 20, **kwargs)
    assert resumed.start_iter == 16  # epoch_2.pth
    assert_bit_equal(weights(full), weights(resumed))
    assert full.lr == resumed.lr
    full_loss, resumed_loss = (
        full.metric_storage["total_loss"],
        resumed.metric_storage["total_loss"],
    )
    assert (full_loss.count, full_loss.global_sum) == (resumed_loss.count, resumed_loss.global_sum)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iteration_based_mid_epoch_resume_is_bit_exact(tmp_path, num_workers):
    def make(work_dir, **kw):
        loader = tiny_loader(shuffle=True, num_workers=num_workers)
        return build(work_dir, loader=loader, **kw)

    kwargs = {"max_iters": 21, "checkpoint_period": 3, "checkpoint_by_epoch": False, "warmup_t": 5}
    kwargs["by_epoch"] = False
    full = make(tmp_path / "full", **kwargs)
    full.train()
    resumed = train_interrupted(lambda **kw: make(tmp_path / "cut", **kw), 13, **kwargs)
    assert resumed.start_iter == 12  # iter_12.pth: mid-epoch (epoch_len 8)
    assert_bit_equal(weights(full), weights(resumed))


def test_auto_resume_and_explicit_resume(make_trainer, tmp_path, caplog):
    make_trainer(max_epochs=1).train()
    trainer = make_trainer(max_epochs=2)
    trainer.train()
    assert trainer.start_iter == 8
    assert "Resumed from checkpoint" in caplog.text
    fresh = make_trainer(max_epochs=2, work_dir=tmp_path / "other")
    fresh.train(auto_resume=False)
    assert fresh.start_iter == 0
    with pytest.raises(FileNotFoundError, match="does-not-exist.pth"):
        fresh.train(resume_from_checkpoint=str(tmp_path / "does-not-exist.pth"))


def test_a_finished_trainer_refuses_to_train_afresh_without_advising_the_same_call(
    make_trainer,
):
    trainer = make_trainer(max_epochs=1)
    trainer.train()
    with pytest.raises(RuntimeError, match="trained up to iteration 8 of 8") as e:
        trainer.train(auto_resume=False)
    assert "build a new model, optimizer and Trainer" in str(e.value)
    assert "auto_resume" not in str(e.value) and "call train()" not in str(e.value)
    loaded = make_trainer(max_epochs=1)
    loaded.train()  # resumes the finished run: nothing to train
    with pytest.raises(RuntimeError, match="trained up to iteration 8 of 8"):
        loaded.train(auto_resume=False)


def test_checkpoint_holds_plain_data_only(make_trainer):
    trainer = make_trainer(max_epochs=1, enable_amp=True)
    trainer.train()
    path = os.path.join(trainer.ckpt_dir, "epoch_1.pth")
    data = torch.load(path, weights_only=True)
    assert set(data) == {
        "progress", "config", "model", "optimizer", "lr_scheduler", "grad_scaler", "metric_storage",
        "hooks", "rng",
    }  # fmt: skip
    assert len(data["rng"]) == 1 and data["rng"][0]["epoch_start"] is None  # one rank, epoch end
    assert data["progress"] == {
        "epoch": 1, "inner_iter": 0, "epoch_len": 8, "iters_done": 8, "world_size": 1,
        "batch_size": 4, "stopped": False,
    }  # fmt: skip
    assert data["hooks"]["CheckpointHook"] == {"saved": ["epoch_1.pth"]}
    assert_bit_equal(data["model"], weights(trainer))


# ---- lifecycle ----------------------------------------------------------------------------


def test_after_train_runs_when_training_raises(make_trainer):
    calls = []

    class Record(HookBase):
        def after_train(self):
            calls.append("after_train")

    trainer = make_trainer()
    trainer.register_hook(Record())
    trainer.register_hook(StopAt(3))
    with pytest.raises(SystemExit):
        trainer.train()
    assert calls == ["after_train"]


def test_trainer_is_freed_after_train(make_trainer):
    trainer = make_trainer(max_epochs=1)
    trainer.train()
    ref = weakref.ref(trainer)
    del trainer
    assert ref() is None  # no cycle: freed without waiting for the garbage collector
    gc.collect()
    assert ref() is None


def test_each_trainer_logs_to_its_own_work_dir(tmp_path):
    a = build(tmp_path / "a", max_epochs=1)
    b = build(tmp_path / "b", max_epochs=1)
    a.train()
    b.train()
    log_a = (tmp_path / "a" / "log.txt").read_text()
    log_b = (tmp_path / "b" / "log.txt").read_text()
    assert str(tmp_path / "a" / "checkpoints") in log_a
    assert str(tmp_path / "a") not in log_b and str(tmp_path / "b" / "checkpoints") in log_b
    assert "PyTorch" in log_a  # the environment table opens every log


def test_hook_info_lists_hooks_in_run_order(make_trainer):
    class Mine(HookBase):
        pass

    trainer = make_trainer()
    trainer.register_hook(Mine())
    assert trainer.hooks.info() == [
        "TimerHook (priority 5)",
        "DistributedHook (priority 10)",
        "Mine (priority 50)",
        "LRUpdateHook (priority 70)",
        "CheckpointHook (priority 80)",
        "LoggerHook (priority 90)",
    ]
    with pytest.raises(TypeError, match="hook must be a HookBase instance, got function"):
        trainer.register_hook(lambda: None)


def test_model_or_module_unwraps_data_parallel(make_trainer):
    model = TinyModel()
    trainer = make_trainer(model=nn.DataParallel(model))
    assert trainer.model_or_module is model


def test_any_sized_iterable_of_batches_works_as_data_loader(make_trainer):
    batches = list(tiny_loader())
    trainer = make_trainer(loader=batches, max_iters=12)
    trainer.train()
    assert trainer.epoch_len == 8 and trainer.metric_storage["total_loss"].count == 12


# ---- cuda_graph=True: what can be checked without a GPU (the rest is in test_cuda.py) -----


class Counter(HookBase):
    """Counts iterations and after_train calls; calls stop() after iteration ``stop_at``."""

    def __init__(self, stop_at=None):
        self.iters, self.trained, self.stop_at = 0, 0, stop_at

    def after_iter(self):
        self.iters += 1
        if self.trainer.cur_iter == self.stop_at:
            self.trainer.stop()

    def after_train(self):
        self.trained += 1


def test_stop_ends_after_the_iteration_and_a_rerun_stays_stopped(make_trainer, tmp_path):
    trainer = make_trainer(max_epochs=2)  # 8 iterations per epoch
    counter = Counter(stop_at=5)
    trainer.register_hook(counter)
    trainer.train()
    assert (trainer.cur_iter, counter.iters, counter.trained) == (5, 6, 1)
    saved = load(os.path.join(trainer.ckpt_dir, "iter_6.pth"))
    assert saved["progress"]["stopped"] and saved["progress"]["inner_iter"] == 6
    assert open(os.path.join(trainer.ckpt_dir, "latest.txt")).read().strip() == "iter_6.pth"

    again, counter = make_trainer(max_epochs=2), Counter()
    again.register_hook(counter)
    again.train()
    assert (again.start_iter, counter.iters, counter.trained) == (6, 0, 1)

    # asked to, it trains on, exactly as if it had never stopped
    on = make_trainer(max_epochs=2)
    on.train(continue_after_stop=True)
    full = make_trainer(max_epochs=2, work_dir=tmp_path / "full")
    full.train()
    for a, b in zip(on.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)


def test_every_after_train_runs_when_a_before_train_or_an_after_train_raises(make_trainer):
    calls = []

    class Record(HookBase):
        def __init__(self, name, fail_in=None):
            self.name, self.fail_in = name, fail_in

        def before_train(self):
            calls.append(f"{self.name}.before_train")
            if self.fail_in == "before_train":
                raise RuntimeError(f"{self.name} failed")

        def after_train(self):
            calls.append(f"{self.name}.after_train")
            if self.fail_in == "after_train":
                raise OSError(f"{self.name} failed")

    trainer = make_trainer()
    trainer.register_hooks([Record("a"), Record("b", fail_in="before_train"), Record("c")])
    with pytest.raises(RuntimeError, match="b failed"):
        trainer.train()
    assert calls == ["a.before_train", "b.before_train", "a.after_train", "b.after_train",
                     "c.after_train"]  # fmt: skip
    assert trainer.cur_iter == -1  # no iteration ran

    calls.clear()
    trainer = make_trainer(max_epochs=1, work_dir=trainer.work_dir + "_2")
    trainer.register_hooks([Record("a", fail_in="after_train"), Record("b")])
    with pytest.raises(OSError, match="a failed"):
        trainer.train()
    assert calls[-2:] == ["a.after_train", "b.after_train"]
    assert os.path.exists(os.path.join(trainer.ckpt_dir, "epoch_1.pth"))  # training itself ended


def test_each_epoch_trains_in_train_mode_after_a_hook_left_eval_mode(make_trainer):
    modes = []

    class LeavesEval(HookBase):
        def before_iter(self):
            modes.append(self.trainer.model.training)

        def after_epoch(self):
            self.trainer.model.eval()  # and never puts it back

    trainer = make_trainer(max_epochs=2)
    trainer.register_hook(LeavesEval())
    trainer.train()
    assert modes == [True] * 16


# ---- work_dir -----------------------------------------------------------------------------


def test_a_relative_work_dir_is_resolved_when_the_trainer_is_built(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = build("runs/exp")
    monkeypatch.chdir(tmp_path.parent)  # a chdir before train()
    trainer.train()
    assert trainer.work_dir == str(tmp_path / "runs" / "exp")
    assert sorted(os.listdir(tmp_path / "runs" / "exp")) == [
        ".lock", "checkpoints", "log.txt", "metrics.jsonl", "run.json", "tb_logs",
    ]  # fmt: skip
    assert not os.path.exists(tmp_path.parent / "runs")


def test_a_work_dir_in_the_home_folder_is_written_there(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    trainer = build("~/runs/x", max_epochs=1)
    trainer.train()
    assert trainer.work_dir == str(tmp_path / "home" / "runs" / "x")
    assert os.path.isfile(tmp_path / "home" / "runs" / "x" / "checkpoints" / "epoch_1.pth")
    assert not os.path.exists(tmp_path / "~")  # no folder named "~" in the current one


def test_a_work_dir_named_like_a_log_file_works(tmp_path):
    trainer = build(tmp_path / "exp1.log")
    trainer.train()
    assert trainer.log_file == str(tmp_path / "exp1.log" / "log.txt")
    assert "Writing checkpoint" in (tmp_path / "exp1.log" / "log.txt").read_text()
    assert os.path.exists(tmp_path / "exp1.log" / "checkpoints" / "epoch_2.pth")


@pytest.mark.parametrize("name", ["log.txt", "run.json", "metrics.jsonl", ".lock"])
def test_no_output_is_written_through_a_symbolic_link_in_work_dir(tmp_path, name):
    outside = tmp_path / "outside"
    outside.write_text("untouched")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / name).symlink_to(outside)
    trainer = build(tmp_path / "work")
    with pytest.raises(RuntimeError, match=f"{name} is a symbolic link .*remove it"):
        trainer.train()
    assert outside.read_text() == "untouched"


# ---- failures and Ctrl-C ------------------------------------------------------------------


class FailAt(HookBase):
    def __init__(self, iteration, error):
        self.iteration, self.error = iteration, error

    def after_iter(self):
        if self.trainer.cur_iter == self.iteration:
            raise self.error


def test_a_failed_train_releases_the_data_loader_workers(make_trainer):
    import multiprocessing

    before = set(multiprocessing.active_children())
    trainer = make_trainer(loader=tiny_loader(shuffle=True, num_workers=2))
    trainer.register_hook(FailAt(3, RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom") as e:
        trainer.train()
    kept = e.value  # as a notebook keeps the last error, and its traceback
    assert set(multiprocessing.active_children()) == before  # now, not with the Trainer
    assert kept.__traceback__ is not None and trainer.cur_iter == 3


def test_a_trainer_that_failed_part_way_resumes_or_refuses_but_never_restarts_in_place(
    make_trainer, tmp_path
):
    """Its model and optimizer hold the failed run's state: training on from them logged the
    iterations as a fresh run's and replaced the old curves."""
    trainer = make_trainer()  # 2 epochs of 8 iterations, a checkpoint at each epoch's end
    trainer.register_hook(FailAt(3, RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    rows = open(os.path.join(trainer.work_dir, "metrics.jsonl")).read()
    with pytest.raises(RuntimeError, match="trained up to iteration 4 of 16") as e:
        trainer.train(auto_resume=False)
    assert "call train() to go on from the last checkpoint" in str(e.value)
    with pytest.raises(RuntimeError, match="trained up to iteration 4 of 16") as e:
        trainer.train()  # none saved yet
    assert "call train()" not in str(e.value)
    assert open(os.path.join(trainer.work_dir, "metrics.jsonl")).read() == rows

    trainer = make_trainer(work_dir=tmp_path / "late")
    fail = FailAt(10, RuntimeError("boom"))
    trainer.register_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    fail.iteration = None
    trainer.train()  # resumes from epoch_1.pth, the state of iteration 8
    assert trainer.start_iter == 8
    full = make_trainer(work_dir=tmp_path / "full")
    full.train()
    assert_bit_equal(weights(trainer), weights(full))


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_ctrl_c_logs_one_line_exits_130_and_erases_the_progress_bar(make_trainer, tmp_path):
    from trainer.hooks import ProgressBarHook

    terminal = Terminal()
    trainer = make_trainer(max_epochs=2)
    trainer.register_hooks([ProgressBarHook(interval=1e-9, stream=terminal),
                            FailAt(10, KeyboardInterrupt())])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        trainer.train()
    assert e.value.code == 130
    log = (tmp_path / "work" / "log.txt").read_text()
    line = "Interrupted (Ctrl-C) in iteration 11 of 16: not saved. Rerun to resume from the last "
    assert log.count(line) == 1
    assert f"checkpoint ({trainer.ckpt_dir}/epoch_1.pth)" in log
    assert "Traceback" not in log
    drawn, blanks, rest = terminal.getvalue().split("\r")[-3:]
    assert blanks == " " * len(drawn.rstrip()) and rest == ""  # the bar's line erased, not left


class ZMQInteractiveShell:
    """IPython's shell in a Jupyter kernel, by its name."""


def test_in_a_notebook_ctrl_c_ends_the_cell_as_an_interrupt(make_trainer, tmp_path, monkeypatch):
    """A kernel shows a KeyboardInterrupt as the usual interrupt; SystemExit(130), right for a
    shell, would end the cell with "To exit: use 'exit', 'quit', or Ctrl-D." instead."""
    import types

    shell = ZMQInteractiveShell()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    trainer = make_trainer(max_epochs=2)
    trainer.register_hook(FailAt(10, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    log = (tmp_path / "work" / "log.txt").read_text()
    assert log.count("Interrupted (Ctrl-C) in iteration 11 of 16: not saved.") == 1
    assert trainer.checkpointer.newest_on_disk() == (f"{trainer.ckpt_dir}/epoch_1.pth", 8)


class _NoImports:  # a process out of file descriptors cannot open a module's file
    def find_spec(self, name, path=None, target=None):
        raise OSError(24, "Too many open files", name)


class FailWithoutFiles(HookBase):
    def __init__(self, nan_first):
        self._nan_first = nan_first

    def after_iter(self):
        if self.trainer.cur_iter == 1 and self._nan_first:  # pending until a log point
            self.trainer.log_losses(aux_loss=torch.tensor(float("nan")))
        if self.trainer.cur_iter == 2:
            sys.meta_path.insert(0, _NoImports())
            raise OSError(24, "Too many open files")


@pytest.mark.parametrize("nan_first", [False, True])
def test_a_failure_that_leaves_no_file_descriptor_is_still_logged(
    make_trainer, monkeypatch, nan_first
):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # restored after the test
    trainer = make_trainer(loader=tiny_loader(shuffle=True, num_workers=2), log_period=50)
    trainer.register_hook(FailWithoutFiles(nan_first))
    with pytest.raises(OSError, match="Too many open files$"):
        trainer.train()
    log = open(trainer.log_file).read()
    assert "Training failed in iteration 3 of " in log and "OSError: [Errno 24]" in log
