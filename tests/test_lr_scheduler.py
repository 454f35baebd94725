import functools
import io
import json

import pytest
import torch
from torch.optim.lr_scheduler import (
    ChainedScheduler,
    ConstantLR,
    CosineAnnealingLR,
    CyclicLR,
    ExponentialLR,
    LambdaLR,
    LinearLR,
    MultiStepLR,
    OneCycleLR,
    PolynomialLR,
    ReduceLROnPlateau,
    SequentialLR,
    StepLR,
)
from torch.utils.data import DataLoader

from trainer import HookBase, LRWarmupScheduler, Trainer
from trainer.lr_scheduler import check_steps

from conftest import TinyModel, tiny_dataset, tiny_loader

# These unit tests step schedulers without an optimizer step, which torch warns about.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")


def make_optimizer(lr=1.0):
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)


def lr_of(opt):
    return opt.param_groups[0]["lr"]


def run_iters(sched, opt, n, epoch_len=None):
    lrs = []
    for i in range(n):
        lrs.append(lr_of(opt))
        sched.iter_update()
        if epoch_len and (i + 1) % epoch_len == 0:
            sched.epoch_update()
    return lrs


def test_fix_warmup_follows_the_linear_formula():
    opt = make_optimizer(lr=1.0)
    sched = LRWarmupScheduler(StepLR(opt, 100), by_epoch=False, warmup_t=5, warmup_init_lr=0.1)
    lrs = run_iters(sched, opt, 7)
    expected = [0.1 * (1 - i / 5) + 1.0 * i / 5 for i in range(5)] + [1.0, 1.0]
    assert lrs == pytest.approx(expected, abs=1e-12)


def test_factor_warmup_scales_the_regular_schedule():
    opt = make_optimizer(lr=1.0)
    sched = LRWarmupScheduler(
        StepLR(opt, step_size=2, gamma=0.5),
        by_epoch=False,
        warmup_t=4,
        warmup_mode="factor",
        warmup_factor=0.2,
    )
    lrs = run_iters(sched, opt, 6)
    regular = [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    factors = [0.2 * (1 - i / 4) + i / 4 for i in range(4)] + [1.0, 1.0]
    assert lrs == pytest.approx([r * f for r, f in zip(regular, factors)])


def test_auto_warmup_ends_on_the_regular_lr_at_warmup_end():
    opt = make_optimizer(lr=1.0)
    sched = LRWarmupScheduler(
        StepLR(opt, step_size=2, gamma=0.5),
        by_epoch=False,
        warmup_t=4,
        warmup_mode="auto",
        warmup_factor=0.1,
    )
    assert sched.warmup_end_lrs == pytest.approx([0.25])
    lrs = run_iters(sched, opt, 6)
    expected = [0.1 * (1 - i / 4) + 0.25 * i / 4 for i in range(4)] + [0.25, 0.25]
    assert lrs == pytest.approx(expected)


def test_epoch_schedule_with_iteration_warmup():
    opt = make_optimizer(lr=1.0)
    sched = LRWarmupScheduler(
        MultiStepLR(opt, milestones=[2], gamma=0.1),
        by_epoch=True,
        epoch_len=3,
        warmup_t=2,
        warmup_init_lr=0.0,
    )
    lrs = run_iters(sched, opt, 9, epoch_len=3)
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1])


def test_warmup_by_epoch():
    opt = make_optimizer(lr=1.0)
    sched = LRWarmupScheduler(StepLR(opt, 10), by_epoch=True, warmup_t=2, warmup_by_epoch=True)
    lrs = []
    for _ in range(3):
        lrs.append(lr_of(opt))
        sched.iter_update()
        assert lr_of(opt) == lrs[-1]  # iterations do not move an epoch warmup
        sched.epoch_update()
    assert lrs == pytest.approx([0.0, 0.5, 1.0])


def test_plateau_steps_on_metrics_and_skips_without_one():
    opt = make_optimizer(lr=1.0)
    sched = LRWarmupScheduler(ReduceLROnPlateau(opt, patience=0, factor=0.5), by_epoch=True)
    sched.epoch_update(1.0)
    sched.epoch_update(2.0)  # worse: halve
    assert lr_of(opt) == 0.5
    sched.epoch_update(None)  # no new metric: no step
    assert lr_of(opt) == 0.5
    sched.epoch_update(3.0)
    assert lr_of(opt) == 0.25


def test_constant_lr_without_scheduler():
    opt = make_optimizer(lr=0.3)
    sched = LRWarmupScheduler(None, optimizer=opt, warmup_t=2, warmup_init_lr=0.1)
    assert run_iters(sched, opt, 4) == pytest.approx([0.1, 0.2, 0.3, 0.3])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"warmup_t": -1}, r"warmup_t must be an int >= 0 \(0 disables warmup\), got -1"),
        ({"warmup_mode": "linear"}, "warmup_mode must be one of"),
        ({"warmup_by_epoch": True, "by_epoch": False}, "warmup_by_epoch=True needs"),
    ],
)
def test_bad_arguments_raise_value_errors(kwargs, message):
    opt = make_optimizer()
    with pytest.raises(ValueError, match=message):
        LRWarmupScheduler(StepLR(opt, 1), **kwargs)


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("warmup_init_lr", -0.5, r"a finite number >= 0"),
        ("warmup_init_lr", float("nan"), r"a finite number >= 0"),
        ("warmup_init_lr", float("inf"), r"a finite number >= 0"),
        ("warmup_factor", -0.1, r"in \[0, 1\]"),
        ("warmup_factor", 5.0, r"in \[0, 1\]"),
        ("warmup_factor", float("nan"), r"in \[0, 1\]"),
    ],
)
def test_a_warmup_start_out_of_range_is_refused_naming_the_range_and_the_value(
    name, value, expected
):
    opt = make_optimizer(lr=1.0)
    with pytest.raises(ValueError, match=rf"^{name} must be {expected}.*got {value!r}"):
        LRWarmupScheduler(StepLR(opt, 1), warmup_t=4, warmup_mode="auto", **{name: value})
    assert lr_of(opt) == 1.0  # untouched
    LRWarmupScheduler(StepLR(opt, 1), warmup_t=4, **{name: 1.0 if "factor" in name else 0.0})


@pytest.mark.parametrize("name", ["by_epoch", "warmup_by_epoch"])
def test_a_flag_given_as_a_string_is_refused(name):
    with pytest.raises(TypeError, match=rf"^{name} must be True or False, got str 'no'"):
        LRWarmupScheduler(StepLR(make_optimizer(), 1), **{name: "no"})


def test_a_warmup_length_that_is_not_an_int_raises_a_type_error():
    with pytest.raises(TypeError, match=r"warmup_t must be an int >= 0 .*, got float 2.5"):
        LRWarmupScheduler(StepLR(make_optimizer(), 1), warmup_t=2.5)


def test_plateau_needs_by_epoch():
    with pytest.raises(ValueError, match="ReduceLROnPlateau .*by_epoch=True"):
        LRWarmupScheduler(ReduceLROnPlateau(make_optimizer()), by_epoch=False)


def test_state_dict_resumes_mid_warmup_exactly():
    def make():
        opt = make_optimizer(lr=1.0)
        sched = LRWarmupScheduler(
            StepLR(opt, step_size=1, gamma=0.5),
            by_epoch=True,
            epoch_len=2,
            warmup_t=3,
            warmup_mode="factor",
            warmup_factor=0.1,
        )
        return opt, sched

    opt, sched = make()
    full = run_iters(sched, opt, 8, epoch_len=2)
    opt, sched = make()
    first = run_iters(sched, opt, 2, epoch_len=2)
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    buffer.seek(0)
    opt, sched = make()
    sched.load_state_dict(torch.load(buffer, weights_only=True))
    assert first + run_iters(sched, opt, 6, epoch_len=2) == full


class SetLRAt(HookBase):
    """Sets the LR by hand after iteration ``at``, and records the LR each iteration starts with."""

    def __init__(self, at, lr):
        self.at, self.lr, self.lrs = at, lr, []

    def before_iter(self):
        self.lrs.append(float(self.trainer.lr))

    def after_iter(self):
        if self.trainer.cur_iter == self.at:
            for group in self.trainer.optimizer.param_groups:
                group["lr"] = self.lr


@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("with_scheduler", [False, True])
def test_the_run_config_gives_the_optimizers_lrs_not_the_warmups_first(
    tmp_path, tensor_lr, with_scheduler
):
    model = TinyModel()
    lr = torch.tensor(0.1) if tensor_lr else 0.1  # one per test: the warmup sets it in place
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = StepLR(optimizer, step_size=1) if with_scheduler else None
    trainer = Trainer(
        model,
        optimizer,
        scheduler,
        tiny_loader(),
        max_epochs=1,
        warmup_t=4,
        warmup_init_lr=0.001,
        work_dir=tmp_path,
    )
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.001)  # warming up
    assert trainer.run_config["base_lrs"] == [pytest.approx(0.1)]


@pytest.mark.parametrize("warmup_t", [0, 4])
def test_an_lr_set_by_hand_is_kept_without_a_scheduler(make_trainer, warmup_t):
    trainer = make_trainer(scheduler=None, max_epochs=3, warmup_t=warmup_t, warmup_init_lr=0.05)
    hand = SetLRAt(at=9, lr=0.001)
    trainer.register_hook(hand)
    trainer.train()
    assert hand.lrs[10:] == [0.001] * 14  # epoch ends re-applied the LR of the start: 0.1
    assert hand.lrs[warmup_t:9] == [0.1] * (9 - warmup_t)
    resumed = make_trainer(scheduler=None, max_epochs=4, warmup_t=warmup_t, warmup_init_lr=0.05)
    again = SetLRAt(at=-1, lr=None)
    resumed.register_hook(again)
    resumed.train()
    assert again.lrs == [0.001] * 8  # the optimizer's state holds it


def test_a_tensor_lr_trains_warms_up_logs_and_resumes_exactly(tmp_path):
    def trainer(work_dir, max_epochs):
        torch.manual_seed(0)
        model = TinyModel()
        optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
        return Trainer(
            model,
            optimizer,
            StepLR(optimizer, step_size=1, gamma=0.5),
            tiny_loader(),
            max_epochs=max_epochs,
            warmup_t=4,
            work_dir=work_dir,
        )

    whole = trainer(tmp_path / "whole", 3)
    lrs = SetLRAt(at=-1, lr=None)  # records the LRs only
    whole.register_hook(lrs)
    whole.train()
    assert lrs.lrs[:5] == pytest.approx([0, 0.0025, 0.005, 0.0075, 0.01])
    assert lrs.lrs[8::8] == pytest.approx([0.005, 0.0025])
    assert json.loads((tmp_path / "whole" / "run.json").read_text())["base_lrs"] == [
        pytest.approx(0.01)
    ]
    trainer(tmp_path / "cut", 2).train()
    trainer(tmp_path / "cut", 3).train()
    end = torch.load(tmp_path / "whole/checkpoints/epoch_3.pth", weights_only=True)
    cut = torch.load(tmp_path / "cut/checkpoints/epoch_3.pth", weights_only=True)
    for key, value in end["model"].items():
        assert torch.equal(value, cut["model"][key])


# ---- how a run steps the schedule: 3 epochs of 16 iterations, unless said -------------------


def per_iteration_cosine(optimizer):
    warm = LinearLR(optimizer, start_factor=0.1, total_iters=5)
    return SequentialLR(optimizer, [warm, CosineAnnealingLR(optimizer, T_max=43)], [5])


class Stream(torch.utils.data.IterableDataset):
    """64 samples, without a length."""

    def __iter__(self):
        return iter(tiny_dataset(64))


def scheduled(tmp_path, scheduler, stream=False, **kwargs):
    """A trainer of 3 epochs of 16 iterations (or ``max_iters``) with ``scheduler(optimizer)``."""
    torch.manual_seed(0)
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(Stream(), batch_size=4) if stream else tiny_loader(64)
    if "max_iters" not in kwargs:
        kwargs.setdefault("max_epochs", 3)
    kwargs.setdefault("checkpoint_period", 0)
    return Trainer(
        model, optimizer, scheduler(optimizer), loader, work_dir=tmp_path, log_period=16, **kwargs
    )


@pytest.mark.parametrize(
    "scheduler, kwargs, message",
    [
        # per-iteration horizons stepped per epoch (by_epoch=True, the default): 3 steps of 48
        (lambda o: OneCycleLR(o, 0.1, total_steps=48), {}, r"by_epoch=True .*OneCycleLR 3 .*48"),
        (lambda o: LinearLR(o, 1.0, 0.0, total_iters=48), {}, r"by_epoch=True .*LinearLR .*48"),
        (lambda o: CosineAnnealingLR(o, T_max=48), {}, r"by_epoch=True .*Cosine.* 48 steps"),
        (lambda o: PolynomialLR(o, total_iters=40), {}, r"by_epoch=True .*PolynomialLR .*40"),
        (lambda o: ConstantLR(o, 0.5, total_iters=48), {}, r"by_epoch=True .*ConstantLR .*48"),
        (lambda o: MultiStepLR(o, [24, 40]), {}, r"by_epoch=True .*MultiStepLR .*40 steps"),
        (per_iteration_cosine, {}, r"by_epoch=True .*SequentialLR .*48 steps"),
        (
            lambda o: ChainedScheduler([ConstantLR(o, 0.5, 5), CosineAnnealingLR(o, 48)]),
            {},
            r"by_epoch=True .*ChainedScheduler .*48 steps",
        ),
        (lambda o: StepLR(o, 10), {"warmup_t": 48, "warmup_by_epoch": True}, r"warmup_by_epoch"),
        # a first try cut short: 2 of the per-iteration schedule's 48 steps
        (lambda o: CosineAnnealingLR(o, 48), {"max_iters": 32}, r"by_epoch=True .* 2 times"),
        # per-epoch horizons stepped per iteration: T_max=3 is over at iteration 3 of 48
        (
            lambda o: CosineAnnealingLR(o, T_max=3),
            {"by_epoch": False},
            r"by_epoch=False .*Cosine.*48 times in 3 epochs \(48 iterations\).* 3 steps",
        ),
        (lambda o: PolynomialLR(o, 3), {"by_epoch": False}, r"by_epoch=False .*PolynomialLR .*3"),
        (lambda o: MultiStepLR(o, [2]), {"by_epoch": False}, r"by_epoch=False .*MultiStepLR .*2"),
        # OneCycleLR raises when stepped past total_steps
        (
            lambda o: OneCycleLR(o, 0.1, total_steps=40),
            {"by_epoch": False},
            r"by_epoch=False .*OneCycleLR 48 times.*total_steps=40.*total_steps=48",
        ),
        (lambda o: OneCycleLR(o, 0.1, total_steps=2), {}, r"by_epoch=True .*total_steps=3"),
        (
            lambda o: OneCycleLR(o, 0.1, total_steps=40),
            {"by_epoch": False, "max_iters": 48, "stream": True},
            r"by_epoch=False .*OneCycleLR 48 times in 48 iterations.*total_steps=40",
        ),
    ],
)
def test_a_schedule_stepped_against_its_horizon_is_refused_at_start(
    tmp_path, scheduler, kwargs, message
):
    with pytest.raises(ValueError, match=message):
        scheduled(tmp_path, scheduler, **kwargs)
    assert not (tmp_path / "checkpoints").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "scheduler, kwargs",
    [
        (lambda o: CosineAnnealingLR(o, T_max=4), {}),  # a bit longer than the run, on purpose
        (lambda o: CosineAnnealingLR(o, T_max=60), {"by_epoch": False}),
        (lambda o: MultiStepLR(o, [1, 2]), {}),  # milestones inside the run
        # a first try of 1 epoch (16 iterations) of a schedule of 10 epochs
        (lambda o: CosineAnnealingLR(o, T_max=10), {"max_epochs": 1}),
        (lambda o: MultiStepLR(o, [24, 40]), {"by_epoch": False}),
        (lambda o: OneCycleLR(o, 0.1, total_steps=3), {}),
        (lambda o: OneCycleLR(o, 0.1, total_steps=48), {"by_epoch": False}),
        (per_iteration_cosine, {"by_epoch": False}),
        (lambda o: LinearLR(o, 0.1, total_iters=5), {"by_epoch": False}),  # a short warmup
        (lambda o: ConstantLR(o, 0.5, total_iters=2), {"by_epoch": False}),
        (lambda o: StepLR(o, 1), {"warmup_t": 5}),  # warmups in iterations may be short
        (lambda o: StepLR(o, 1), {"warmup_t": 1, "warmup_by_epoch": True}),
        # max_iters cuts the third epoch, which ends and steps the schedule all the same
        (lambda o: OneCycleLR(o, 0.1, total_steps=3), {"max_iters": 40}),
        (lambda o: OneCycleLR(o, 0.1, total_steps=40), {"max_iters": 40, "by_epoch": False}),
        # a stream: max_iters only, its epochs unknown
        (lambda o: OneCycleLR(o, 0.1, total_steps=48), {"max_iters": 48, "stream": True}),
        (
            lambda o: OneCycleLR(o, 0.1, total_steps=48),
            {"max_iters": 48, "by_epoch": False, "stream": True},
        ),
        (lambda o: CosineAnnealingLR(o, T_max=3), {"max_iters": 48, "stream": True}),
    ],
)
def test_a_schedule_stepped_as_its_horizon_counts_trains_to_the_end(tmp_path, scheduler, kwargs):
    trainer = scheduled(tmp_path, scheduler, **kwargs)
    trainer.train()
    assert trainer.cur_iter + 1 == trainer.max_iters


@pytest.mark.parametrize(
    "scheduler",
    [
        lambda o: LambdaLR(o, lambda step: max(0.0, 1 - step / 48)),  # get_scheduler's kind
        lambda o: StepLR(o, 30),
        lambda o: ExponentialLR(o, 0.99),
        lambda o: CyclicLR(o, 0.01, 0.1, step_size_up=24),
        lambda o: ChainedScheduler([ConstantLR(o, 0.5, 48), ExponentialLR(o, 0.99)]),
    ],
)
@pytest.mark.parametrize("by_epoch", [True, False])
def test_a_schedule_of_unknown_horizon_is_never_refused(tmp_path, scheduler, by_epoch):
    scheduled(tmp_path, scheduler, by_epoch=by_epoch)
    scheduled(tmp_path, lambda o: ReduceLROnPlateau(o), by_epoch=True)


def linear_decay(step, num_training_steps):
    return max(0.0, 1 - step / num_training_steps)


def linear_decay_phases(step, num_warmup_steps, num_stable_steps, num_decay_steps):
    end = num_warmup_steps + num_stable_steps
    return 1.0 if step < end else max(0.0, 1 - (step - end) / num_decay_steps)


@pytest.mark.parametrize(
    "scheduler, by_epoch, epochs, epoch_len, iters, refused",
    [
        # max_iters within the first epoch: a schedule built for those iterations
        (lambda o: OneCycleLR(o, 1.0, total_steps=1000), True, 1, 5000, 1000, True),
        (lambda o: CosineAnnealingLR(o, 3000), True, 2, 2000, 3000, True),
        # transformers' get_scheduler: a LambdaLR of a partial that carries its length
        (
            lambda o: LambdaLR(o, functools.partial(linear_decay, num_training_steps=48)),
            True,
            3,
            16,
            48,
            True,
        ),
        (
            lambda o: LambdaLR(o, functools.partial(linear_decay, num_training_steps=48)),
            False,
            3,
            16,
            48,
            False,
        ),
        # warmup_stable_decay's: its phases, 2 + 36 + 10 steps
        (
            lambda o: LambdaLR(
                o,
                functools.partial(
                    linear_decay_phases, num_warmup_steps=2, num_stable_steps=36, num_decay_steps=10
                ),
            ),
            True,
            3,
            16,
            48,
            True,
        ),
        # per-epoch milestones past a run whose epochs are short
        (lambda o: MultiStepLR(o, [100, 150]), True, 120, 98, 120 * 98, False),
        # per-iteration decays that hold their end, ending before an epoch does
        (lambda o: MultiStepLR(o, [600, 900]), False, 1, 2000, 1000, False),
        (lambda o: LinearLR(o, 1.0, 0.1, total_iters=200), False, 5, 1000, 5000, False),
        # a cosine shorter than an epoch, stepped per iteration, climbs again in the epoch
        (lambda o: CosineAnnealingLR(o, 200), False, 5, 1000, 5000, True),
    ],
)
def test_where_a_horizon_counts_iterations_and_where_epochs(
    scheduler, by_epoch, epochs, epoch_len, iters, refused
):
    optimizer = torch.optim.SGD(TinyModel().parameters(), lr=0.1)
    warmup = LRWarmupScheduler(scheduler(optimizer), by_epoch, epoch_len, optimizer=optimizer)
    if refused:
        with pytest.raises(ValueError, match=f"by_epoch={by_epoch} "):
            check_steps(warmup, epochs, iters, epoch_len)
    else:
        check_steps(warmup, epochs, iters, epoch_len)


class StopAfter(HookBase):
    def __init__(self, iters):
        self.iters = iters

    def after_iter(self):
        if self.trainer.cur_iter + 1 == self.iters:
            self.trainer.stop()


def test_a_resumed_one_cycle_schedule_ends_as_the_whole_run(tmp_path):
    def one_cycle(optimizer):
        return OneCycleLR(optimizer, 0.1, total_steps=48)

    whole = scheduled(tmp_path / "whole", one_cycle, by_epoch=False)
    whole_lrs = SetLRAt(at=-1, lr=None)  # records the LRs only
    whole.register_hook(whole_lrs)
    whole.train()
    cut = scheduled(tmp_path / "cut", one_cycle, by_epoch=False)
    cut.register_hook(StopAfter(20))  # saves where it stops, in mid-epoch
    cut.train()
    resumed = scheduled(tmp_path / "cut", one_cycle, by_epoch=False)
    resumed_lrs = SetLRAt(at=-1, lr=None)
    resumed.register_hook(resumed_lrs)
    resumed.train(continue_after_stop=True)
    assert resumed.start_iter == 20
    assert resumed_lrs.lrs == whole_lrs.lrs[20:]


@pytest.mark.parametrize(
    "scheduler, kwargs, said",
    [
        (
            lambda o: OneCycleLR(o, 0.1, total_steps=48),
            {"by_epoch": False},
            "OneCycleLR stepped per iteration (by_epoch=False), 48 steps in this run (its "
            "horizon: 48); no warmup.",
        ),
        (
            lambda o: CosineAnnealingLR(o, T_max=3),
            {"warmup_t": 10},
            "CosineAnnealingLR stepped per epoch (by_epoch=True), 3 steps in this run (its "
            "horizon: 3); warmup: 10 iterations, 'fix' mode.",
        ),
        (lambda o: LambdaLR(o, lambda s: 1.0), {}, "LambdaLR stepped per epoch (by_epoch=True), 3"),
        (lambda o: None, {}, "constant (lr_scheduler=None); no warmup."),
        (
            lambda o: StepLR(o, 1),
            {"max_iters": 48, "stream": True},
            "StepLR stepped per epoch (by_epoch=True), at each end of the data stream",
        ),
    ],
)
def test_the_first_lines_say_how_the_schedule_steps(tmp_path, caplog, scheduler, kwargs, said):
    scheduled(tmp_path, scheduler, **kwargs).train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LR schedule:")]
    assert len(lines) == 1 and said in lines[0]
