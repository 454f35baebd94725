import collections
import gc
import math
import os
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer import HookBase, Trainer
from trainer.cuda_graph import _flatten, _unflatten, check_graphable

from conftest import TinyModel, build, tiny_dataset, tiny_loader


def weights(trainer):
    return {k: v.clone() for k, v in trainer.model_or_module.state_dict().items()}


def assert_bit_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_epochs": 2, "max_iters": 5}, ValueError, r"exactly one of max_epochs or max_iters"),
        ({"max_epochs": 0}, ValueError, r"got max_epochs=0, max_iters=0"),
        ({"max_epochs": -1}, ValueError, r"max_epochs must be an int >= 0, got -1"),
        ({"max_epochs": 1.5}, ValueError, r"max_epochs must be an int >= 0, got 1.5"),
        ({"log_period": 0}, ValueError, r"log_period must be a positive int, got 0"),
        ({"accumulation_steps": 0}, ValueError, r"accumulation_steps must be a positive int"),
        ({"max_num_checkpoints": 0}, ValueError, r"max_num_checkpoints must be a positive int"),
        ({"clip_grad_norm": -1.0}, ValueError, r"clip_grad_norm must be >= 0"),
        ({"amp_dtype": torch.float64}, ValueError, r"amp_dtype must be torch.float16"),
        ({"accumulation_steps": 9}, ValueError, r"8 batches, fewer than accumulation_steps=9"),
    ],
)
def test_bad_arguments_raise_clear_errors(make_trainer, kwargs, error, message):
    with pytest.raises(error, match=message):
        make_trainer(**kwargs)


def test_bad_types_raise_type_errors(tmp_path):
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        Trainer("model", opt, None, tiny_loader(), max_epochs=1, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        Trainer(model, None, None, tiny_loader(), max_epochs=1, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="lr_scheduler must be"):
        Trainer(model, opt, "cosine", tiny_loader(), max_epochs=1, work_dir=str(tmp_path))


def test_empty_and_unsized_data_loaders_are_refused(make_trainer):
    with pytest.raises(ValueError, match="data_loader is empty"):
        make_trainer(loader=DataLoader(tiny_dataset(0), batch_size=4))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from tiny_dataset()

    with pytest.raises(TypeError, match="data_loader must have a length"):
        make_trainer(loader=DataLoader(Stream(), batch_size=4))


class ReturnsWhat(nn.Module):
    def __init__(self, out):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.out = out

    def forward(self, batch):
        return self.out(self.w)


@pytest.mark.parametrize(
    "out, error, message",
    [
        (
            lambda w: w * 2,
            ValueError,
            r"Loss 'total_loss' must be a scalar tensor, got shape \(3,\)",
        ),
        (lambda w: "loss", TypeError, r"scalar loss tensor or a non-empty dict .* got str"),
        (lambda w: {}, TypeError, r"non-empty dict of scalar loss tensors, got dict"),
        (lambda w: {"a": 1.0}, TypeError, r"Loss 'a' must be a tensor, got float"),
        (lambda w: {"a": w}, ValueError, r"Loss 'a' must be a scalar tensor"),
    ],
)
def test_wrong_model_output_raises(make_trainer, out, error, message):
    trainer = make_trainer(model=ReturnsWhat(out))
    with pytest.raises(error, match=message):
        trainer.train()


def test_unwritable_work_dir_fails_at_construction(make_trainer, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    with pytest.raises(PermissionError, match="is not writable"):
        make_trainer(work_dir=locked)


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


def test_dict_losses_are_summed_and_each_logged(make_trainer):
    class TwoLosses(TinyModel):
        def forward(self, batch):
            x, y = batch
            pred = self.linear(x)
            return {"mse": nn.functional.mse_loss(pred, y), "l1": nn.functional.l1_loss(pred, y)}

    trainer = make_trainer(model=TwoLosses(), max_epochs=1, log_period=1)
    trainer.train()
    storage = trainer.metric_storage
    total = storage["mse"].latest + storage["l1"].latest
    assert storage["total_loss"].latest == pytest.approx(total, rel=1e-6)


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


def test_accumulation_matches_one_big_batch(make_trainer, tmp_path):
    loader = tiny_loader(batch_size=4)
    small = make_trainer(
        loader=loader, accumulation_steps=2, max_epochs=1, lr=0.05, work_dir=tmp_path / "a"
    )
    small.model.dropout.p = 0.0
    big = make_trainer(
        loader=tiny_loader(batch_size=8), max_epochs=1, lr=0.05, work_dir=tmp_path / "b"
    )
    big.model.dropout.p = 0.0
    small.train()
    big.train()
    assert small.epoch_len == 4 and small.cur_iter == 3
    for a, b in zip(weights(small).values(), weights(big).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert small.metric_storage["total_loss"].count == 4


def test_clip_grad_norm_clips_and_logs_the_norm(make_trainer):
    norms = []

    class RecordNorm(HookBase):
        def after_iter(self):
            grads = [p.grad for p in self.trainer.model.parameters()]
            norms.append(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item())

    trainer = make_trainer(clip_grad_norm=0.01, max_epochs=1, log_period=1)
    trainer.register_hook(RecordNorm())
    trainer.train()
    assert max(norms) <= 0.01 + 1e-6
    assert trainer.metric_storage["grad_norm"].latest > 0.01  # the norm before clipping


def test_bfloat16_autocast_on_cpu(make_trainer):
    seen = []

    class Probe(TinyModel):
        def forward(self, batch):
            seen.append((torch.is_autocast_enabled("cpu"), self.linear(batch[0]).dtype))
            return super().forward(batch)

    trainer = make_trainer(model=Probe(), enable_amp=True, max_epochs=1)
    assert trainer.amp_dtype == torch.bfloat16
    trainer.train()
    assert seen[0] == (True, torch.bfloat16)
    assert "amp_skipped_steps" not in trainer.metric_storage  # bfloat16 needs no scaler


class RecordLR(HookBase):
    def __init__(self):
        self.lrs = []

    def before_iter(self):
        self.lrs.append(self.trainer.lr)


class InfGradAt(torch.autograd.Function):
    """Identity whose gradient is inf in the backward passes listed in ``bad``."""

    calls = 0
    bad: set = set()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        InfGradAt.calls += 1
        return grad * math.inf if InfGradAt.calls - 1 in InfGradAt.bad else grad


# Non-fused: GradScaler does not call optimizer.step(). Fused: the step runs and skips on the
# device, told by the scaler's found_inf flag, which the trainer keeps on the device (no sync).
@pytest.mark.parametrize("fused", [False, True])
def test_float16_scaler_skips_are_counted_and_the_schedule_counts_iterations(make_trainer, fused):
    class Model(TinyModel):
        def forward(self, batch):
            x, y = batch
            weight = InfGradAt.apply(self.linear.weight)
            return nn.functional.mse_loss(nn.functional.linear(x, weight, self.linear.bias), y)

    InfGradAt.calls, InfGradAt.bad = 0, {2}
    trainer = make_trainer(
        model=Model(), enable_amp=True, amp_dtype=torch.float16, max_iters=6, log_period=1,
        scheduler=None, warmup_t=4, warmup_init_lr=0.0, fused=fused,
    )  # fmt: skip
    record, skipped, weights = RecordLR(), [], []

    class RecordSkip(HookBase):
        def after_iter(self):
            skipped.append(self.trainer.step_skipped)
            weights.append(self.trainer.model.linear.weight.detach().clone())

    trainer.register_hook(record)
    trainer.register_hook(RecordSkip())
    trainer.train()
    # float16 at the initial scale of 2**16 overflows on its own at first; ours is iteration 2
    assert skipped[2] and not skipped[-1]
    assert torch.equal(weights[2], weights[1])  # a skipped step leaves the weights alone
    assert not torch.equal(weights[-1], weights[-2])
    assert trainer.metric_storage["amp_skipped_steps"].global_sum == sum(skipped)
    # the warmup (0 to 0.1 over 4 iterations) counts iterations, skipped steps included
    assert record.lrs == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1])


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
        priority = 0  # first in every event: brackets train_one_iter and the flush

        def before_iter(self):
            self.start = counter["n"]

        def after_iter(self):
            reads[self.trainer.cur_iter] = counter["n"] - self.start

    # unshuffled: RandomSampler also reads CPU tensors (seed, randperm) at a pass's first batch
    trainer = make_trainer(
        loader=tiny_loader(), max_iters=24, log_period=8, clip_grad_norm=1.0, checkpoint_period=100
    )
    trainer.register_hook(Snapshot())
    start_pass = trainer._start_data_pass

    def start_pass_uncounted():
        # The DataLoader draws its seed with .item() on a CPU tensor at every new pass: a host
        # read of PyTorch's own, once per epoch, with no device involved.
        counter["paused"] = True
        try:
            return start_pass()
        finally:
            counter["paused"] = False

    trainer._start_data_pass = start_pass_uncounted
    trainer.train()
    log_iters = {7, 15, 23}
    assert all(reads[i] == 0 for i in range(24) if i not in log_iters), reads
    assert all(reads[i] > 0 for i in log_iters)  # the counter does see the one flush per period


# ---- non-finite losses --------------------------------------------------------------------


class NaNAt(TinyModel):
    def __init__(self, bad_iter):
        super().__init__()
        self.bad_iter, self.calls = bad_iter, 0

    def forward(self, batch):
        loss = super().forward(batch)
        self.calls += 1
        return loss * math.nan if self.calls - 1 == self.bad_iter else loss


def test_nan_loss_raises_at_the_next_log_point_naming_the_first_bad_iteration(make_trainer):
    reached = []

    class Last(HookBase):
        def after_iter(self):
            reached.append(self.trainer.cur_iter)

    trainer = make_trainer(model=NaNAt(5), max_iters=20, log_period=8, checkpoint_period=100)
    trainer.register_hook(Last())
    with pytest.raises(FloatingPointError, match=r"NaN or infinite at iteration 5 \(epoch 0\)"):
        trainer.train()
    assert reached == list(range(7))  # raised at iteration 7, the log point
    assert trainer.metric_storage["total_loss"].count == 5  # iterations 0-4 were recorded


def test_nan_loss_never_reaches_a_checkpoint(make_trainer):
    trainer = make_trainer(
        model=NaNAt(5), max_iters=20, log_period=10, checkpoint_period=2, checkpoint_by_epoch=False
    )
    with pytest.raises(FloatingPointError, match="iteration 5"):
        trainer.train()
    saved = sorted(os.listdir(trainer.ckpt_dir))
    assert saved == ["iter_2.pth", "iter_4.pth", "latest.txt"]
    with open(os.path.join(trainer.ckpt_dir, "latest.txt")) as f:
        assert f.read() == "iter_4.pth"


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
    with pytest.raises(KeyboardInterrupt):
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


def test_resume_with_a_different_epoch_length_is_refused(make_trainer):
    make_trainer(max_epochs=1).train()
    trainer = make_trainer(max_epochs=2, loader=tiny_loader(n=16))  # another dataset
    with pytest.raises(ValueError, match="saved with 8 iterations per epoch, this trainer has 4"):
        trainer.train()


class Recording(TinyModel):
    """Remembers the samples it was fed, in order."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, batch):
        self.seen.extend(map(tuple, batch[0].tolist()))
        return super().forward(batch)


def stop_after_6_of_8_iterations(make_trainer, model=None):
    """The path of a checkpoint saved in the middle of a one-epoch run."""
    trainer = make_trainer(
        max_epochs=1, model=model, checkpoint_by_epoch=False, checkpoint_period=6
    )
    trainer.train()
    return os.path.join(trainer.ckpt_dir, "iter_6.pth")


def test_a_changed_batch_size_maps_the_position_by_consumed_samples(make_trainer, caplog):
    # resumed after 6 of 8 iterations of 4 samples, with batches of 8
    first = Recording()
    mid_epoch = stop_after_6_of_8_iterations(make_trainer, first)
    resumed = Recording()
    loader = tiny_loader(batch_size=8, shuffle=True)
    make_trainer(max_epochs=1, model=resumed, loader=loader).train(resume_from_checkpoint=mid_epoch)
    assert (
        "epoch 0 stopped after 6 iterations = 24 samples, so this run goes on from iteration 3 "
        "of 4 of that epoch" in caplog.text
    )
    assert len(resumed.seen) == 8 and resumed.seen == first.seen[24:]  # what the epoch had left


def test_a_changed_batch_size_that_cannot_continue_at_the_sample_is_refused(make_trainer):
    mid_epoch = stop_after_6_of_8_iterations(make_trainer)
    trainer = make_trainer(max_epochs=1, loader=tiny_loader(batch_size=5))  # 24 % 5 != 0
    with pytest.raises(RuntimeError, match=r"\(6 of 8 iterations, 24 samples\).*cannot continue"):
        trainer.train(resume_from_checkpoint=mid_epoch)


def test_a_changed_batch_size_at_an_epoch_end_needs_no_mapping(make_trainer, caplog):
    make_trainer(max_epochs=1).train()
    trainer = make_trainer(max_epochs=2, loader=tiny_loader(batch_size=8))
    trainer.train()
    assert "1 processes x batches of 4 to 1 x 8, at the start of epoch 1" in caplog.text
    assert (trainer.start_iter, trainer.cur_iter) == (4, 7)


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
        "epoch": 1, "inner_iter": 0, "epoch_len": 8, "world_size": 1, "batch_size": 4,
        "stopped": False,
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
    with pytest.raises(KeyboardInterrupt):
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
    assert trainer.hook_info == [
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


def test_log_keeps_tensors_on_device_until_the_log_point(make_trainer):
    class LogAcc(HookBase):
        def after_iter(self):
            self.trainer.log(self.trainer.cur_iter, acc=torch.tensor(0.5))

    trainer = make_trainer(max_epochs=1, log_period=4)
    trainer.register_hook(LogAcc())
    trainer.train()
    assert trainer.metric_storage["acc"].count == 8
    with pytest.raises(ValueError, match=r"'bad' must be a number or a one-element tensor"):
        trainer.log(0, bad=torch.ones(2))


def test_any_sized_iterable_of_batches_works_as_data_loader(make_trainer):
    batches = list(tiny_loader())
    trainer = make_trainer(loader=batches, max_iters=12)
    trainer.train()
    assert trainer.epoch_len == 8 and trainer.metric_storage["total_loss"].count == 12


# ---- cuda_graph=True: what can be checked without a GPU (the rest is in test_cuda.py) -----


def test_cuda_graph_refuses_what_it_cannot_capture(make_trainer):
    with pytest.raises(ValueError, match="needs a model on a CUDA device, got cpu"):
        make_trainer(cuda_graph=True)
    cuda = torch.device("cuda")
    model = TinyModel()
    plain_sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"SGD without capturable=True \(or fused=True for SGD"):
        check_graphable(model, plain_sgd, cuda, float16_scaler=False)
    check_graphable(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True), cuda, False)
    fused_only = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    with pytest.raises(ValueError, match="Adam without capturable=True"):
        check_graphable(model, fused_only, cuda, float16_scaler=False)
    capturable = torch.optim.Adam(model.parameters(), lr=0.1, capturable=True)
    check_graphable(model, capturable, cuda, float16_scaler=False)  # fine
    with pytest.raises(ValueError, match="float16 AMP needs a fused optimizer"):
        check_graphable(model, capturable, cuda, float16_scaler=True)
    with pytest.raises(ValueError, match="DataParallel-wrapped"):
        check_graphable(nn.DataParallel(model), capturable, cuda, float16_scaler=False)


def test_cuda_graph_batch_layouts_round_trip():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"pair": Pair(torch.ones(2, 3), torch.zeros(2)), "ids": [torch.arange(2)], "k": 7}
    tensors, layout = _flatten([batch])
    assert len(tensors) == 3
    rebuilt = _unflatten(layout, iter(tensors))[0]
    assert isinstance(rebuilt["pair"], Pair) and rebuilt["k"] == 7
    assert rebuilt["pair"].x is tensors[0] and rebuilt["ids"][0] is tensors[2]
    partial = {"pair": Pair(torch.ones(1, 3), torch.zeros(1)), "ids": [torch.arange(1)], "k": 7}
    assert _flatten([partial])[1] != layout
    assert _flatten([{**batch, "pair": Pair(torch.ones(2, 3), torch.ones(2))}])[1] == layout
