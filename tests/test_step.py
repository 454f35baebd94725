"""The step's public building blocks: an override of ``train_one_iter`` written with them keeps
every feature of the built-in step."""

import json
import logging
import math
import os
import re
import types

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from trainer import EvalHook, HookBase, Trainer

from conftest import RecordLR, TinyModel, build, count_host_reads, tiny_loader


class PublicStep(Trainer):
    """The built-in step again, written with the public methods only."""

    update = True  # call update_scaler() (the trainer calls it otherwise)

    def train_one_iter(self):
        batches = [self.next_batch() for _ in range(self.accumulation_steps)]
        self.optimizer.zero_grad(set_to_none=True)
        k = len(batches)
        for i, batch in enumerate(batches):
            with self.no_gradient_sync(i < k - 1):
                with self.autocast():
                    loss = self.model(batch)
                self.backward(loss / k if k > 1 else loss)
        self.clip_and_step()  # logs grad_norm as the built-in step does
        if self.update:
            self.update_scaler()
        self.log_losses(total_loss=loss.detach())


def weights(trainer):
    return trainer.model_or_module.state_dict()


@pytest.mark.parametrize(
    "options",
    [
        {"enable_amp": True, "clip_grad_norm": 0.5, "accumulation_steps": 2},  # bfloat16
        {"enable_amp": True, "amp_dtype": torch.float16, "clip_grad_norm": 0.5},
    ],
)
@pytest.mark.parametrize("update", [True, False])
def test_an_override_with_the_public_methods_trains_as_the_built_in_step(
    tmp_path, monkeypatch, options, update
):
    monkeypatch.setattr(PublicStep, "update", update)
    builtin = build(tmp_path / "builtin", max_epochs=2, **options)
    builtin.train()
    override = build(tmp_path / "override", max_epochs=2, cls=PublicStep, **options)
    override.train()
    a, b = weights(builtin), weights(override)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert builtin.grad_scaler.state_dict() == override.grad_scaler.state_dict()
    assert override.metric_storage["grad_norm"].count == builtin.metric_storage["grad_norm"].count
    norms = [t.metric_storage["grad_norm"].state_dict()["window"] for t in (builtin, override)]
    assert norms[0] == norms[1]


def test_losses_an_override_logs_are_nan_checked(make_trainer):
    class NaNAt3(Trainer):
        def train_one_iter(self):
            self.optimizer.zero_grad()
            loss = self.model(self.next_batch())
            self.backward(loss)
            self.clip_and_step()
            bad = loss.detach() * (math.nan if self.cur_iter == 3 else 1.0)
            self.log_losses(my_loss=bad)

    trainer = make_trainer(max_iters=8, log_period=4, checkpoint_period=100, cls=NaNAt3)
    with pytest.raises(FloatingPointError, match=r"iteration 4 \(epoch 1\).*my_loss"):
        trainer.train()


def test_checkpointer_register_refuses_what_cannot_be_saved(make_trainer):
    trainer = make_trainer()
    with pytest.raises(TypeError, match=r"checkpointer\.register\('x', obj\) needs state_dict\(\)"):
        trainer.checkpointer.register("x", 3)
    trainer.checkpointer.register("opt", torch.optim.SGD(trainer.model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="'opt' is registered already"):
        trainer.checkpointer.register("opt", torch.optim.SGD(trainer.model.parameters(), lr=1))


def test_a_registered_optimizer_resumes_exactly(make_trainer, tmp_path):
    """A second optimizer with momentum, stepped by an override: killed (here, an exception)
    and resumed, training ends with the weights of an uninterrupted run."""

    class TwoOptimizers(Trainer):
        def train_one_iter(self):
            self.optimizer.zero_grad()
            self.bias_optimizer.zero_grad()
            loss = self.model(self.next_batch())
            self.backward(loss)
            self.clip_and_step()  # the weight's optimizer
            self.clip_and_step(self.bias_optimizer)
            self.log_losses(total_loss=loss.detach())

    def make(work_dir, crash_at=None):
        model = build(work_dir / "unused").model  # seeded TinyModel
        weight_opt = torch.optim.SGD([model.linear.weight], lr=0.1, momentum=0.9)
        bias_opt = torch.optim.SGD([model.linear.bias], lr=0.05, momentum=0.9)
        loader = build(work_dir / "unused").data_loader
        trainer = TwoOptimizers(model, weight_opt, None, loader, max_epochs=3, work_dir=work_dir)
        trainer.bias_optimizer = bias_opt
        trainer.checkpointer.register("bias_optimizer", bias_opt)
        if crash_at is not None:
            from trainer import HookBase

            class Crash(HookBase):
                def after_iter(self):
                    if self.trainer.cur_iter == crash_at:
                        raise KeyboardInterrupt

            trainer.register_hook(Crash())
        return trainer

    full = make(tmp_path / "full")
    full.train()
    cut = make(tmp_path / "cut", crash_at=19)
    with pytest.raises(SystemExit):
        cut.train()
    resumed = make(tmp_path / "cut")
    resumed.train()
    assert resumed.start_iter == 16
    a, b = weights(full), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


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
        (lambda w: "loss", TypeError, r"model must return .* got str"),
        (lambda w: {}, TypeError, r"model must return .* got dict"),
        (lambda w: {"a": 1.0}, TypeError, r"'a'.* got float"),
        (lambda w: {"loss": 1.0}, TypeError, r"'loss'.* got float.*not .*\.item\(\)"),
        (lambda w: {"loss": w * 2}, ValueError, r"'loss'.* shape \(3,\).*\.mean\(\)"),
        (lambda w: types.SimpleNamespace(loss=None), TypeError, r"model must return .* got"),
        (lambda w: {"loss": None, "logits": w}, TypeError, r"'loss' is None.*labels"),
        (lambda w: {"mse": w.sum(), "acc": 0.5}, TypeError, r"'acc'.* float.*as a tensor"),
    ],
)
def test_wrong_model_output_raises(make_trainer, out, error, message):
    trainer = make_trainer(model=ReturnsWhat(out))
    with pytest.raises(error, match=message):
        trainer.train()


def test_a_dict_of_losses_with_an_output_that_is_not_one_is_refused_naming_it(make_trainer):
    class WithLogits(TinyModel):
        def forward(self, batch):
            x, y = batch
            pred = self.linear(x)
            return {"mse": nn.functional.mse_loss(pred, y), "logits": pred}

    trainer = make_trainer(model=WithLogits())
    with pytest.raises(ValueError, match=r"'logits'.* shape \(4, 1\).*'loss' entry") as error:
        trainer.train()
    # reducing is advised for a loss left unreduced only, never for logits
    assert "a loss: reduce it" in str(error.value)
    assert "another output (logits): return it beside" in str(error.value)


@pytest.mark.parametrize("accumulation_steps, error", [(1, None), (2, ValueError)])
def test_entries_that_vary_between_micro_batches_are_refused_naming_them(
    make_trainer, accumulation_steps, error
):
    class Varying(TinyModel):
        calls = 0

        def forward(self, batch):
            x, y = batch
            Varying.calls += 1
            losses = {"mse": nn.functional.mse_loss(self.linear(x), y)}
            if Varying.calls % 2 == 0:  # l1 in every other micro-batch
                losses["l1"] = nn.functional.l1_loss(self.linear(x), y)
            return losses

    trainer = make_trainer(model=Varying(), accumulation_steps=accumulation_steps)
    if error is None:
        trainer.train()  # iterations may return other entries
    else:
        with pytest.raises(
            error, match=r"returned 'l1' for some micro-batches.*accumulation_steps"
        ):
            trainer.train()


class LossAndOutputs(TinyModel):
    """Returns what a Hugging Face model does: the total ``loss``, a part of it, and outputs."""

    def forward(self, batch):
        x, y = batch
        pred = self.linear(self.dropout(x))
        aux = 0.1 * pred.pow(2).mean()  # in the loss already, as an MoE model's aux_loss
        loss = nn.functional.mse_loss(pred, y) + aux
        return {"loss": loss, "logits": pred, "aux_loss": aux, "hidden": (x,), "past": None}


@pytest.mark.parametrize("wrap", [dict, types.SimpleNamespace], ids=["mapping", "attribute"])
def test_an_output_with_a_loss_trains_on_the_loss_alone(make_trainer, tmp_path, wrap):
    class Output(LossAndOutputs):
        def forward(self, batch):
            return wrap(**super().forward(batch))

    torch.manual_seed(0)  # the same initial weights in both runs
    trainer = make_trainer(model=Output(), max_epochs=1, log_period=1)
    trainer.train()

    class LossAlone(LossAndOutputs):
        def forward(self, batch):
            return super().forward(batch)["loss"]

    torch.manual_seed(0)
    alone = make_trainer(model=LossAlone(), max_epochs=1, log_period=1, work_dir=tmp_path / "a")
    alone.train()
    for key, value in weights(alone).items():  # aux_loss not added again, logits not summed
        assert torch.equal(value, weights(trainer)[key])
    storage = trainer.metric_storage
    expected = {"total_loss"} | ({"aux_loss"} if wrap is dict else set())
    assert expected <= set(storage) and not {"loss", "logits", "hidden", "past"} & set(storage)
    assert storage["total_loss"].global_sum == alone.metric_storage["total_loss"].global_sum
    if wrap is dict:
        assert 0 < storage["aux_loss"].latest < storage["total_loss"].latest


class HuggingFaceLike(dict):
    """A mapping that is not a plain dict, as a Hugging Face ``ModelOutput`` (an OrderedDict)."""


@pytest.mark.parametrize(
    "wrap, warned",
    [(dict, True), (HuggingFaceLike, False), (types.SimpleNamespace, False)],
    ids=["dict", "output", "attribute"],
)
def test_a_dict_with_a_loss_and_another_with_a_gradient_warns_once(
    make_trainer, caplog, wrap, warned
):
    class LossAndReg(TinyModel):
        def forward(self, batch):
            loss = super().forward(batch)
            return wrap(loss=loss, reg=100 * loss, acc=loss.detach())

    trainer = make_trainer(model=LossAndReg(), max_iters=4)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "'reg'" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)  # once, not per iteration
    if warned:  # says what is trained, and the two ways to train the sum
        assert "'loss'" in warnings[0] and "'acc'" not in warnings[0]
        assert "into 'loss'" in warnings[0] and "drop" in warnings[0]


@pytest.mark.parametrize("name", ["iter", "epoch", "lr", "grad_norm", "total_loss", "lr/group1"])
@pytest.mark.parametrize("with_loss", [True, False], ids=["loss", "losses"])
def test_an_output_named_like_the_trainers_metrics_is_refused(make_trainer, name, with_loss):
    class Clashing(TinyModel):
        calls = 0

        def forward(self, batch):
            loss = super().forward(batch)
            self.calls += 1
            out = {"loss" if with_loss else "mse": loss, "acc": loss.detach()}
            if self.calls == 3:  # a name that appears late is refused too
                out[name] = torch.tensor(123.0)
            return out

    trainer = make_trainer(model=Clashing(), clip_grad_norm=1.0, max_iters=4, log_period=1)
    with pytest.raises(ValueError, match=rf"{re.escape(repr(name))}.*rename") as error:
        trainer.train()
    assert trainer.cur_iter == 2  # at the iteration that returned it, before anything is logged
    assert error.value.args[0].count("\n") < 3
    assert trainer.metric_storage["total_loss"].count == 2


def test_a_nan_metric_is_logged_and_only_the_loss_is_nan_checked(make_trainer, tmp_path):
    class MaskedAccuracy(TinyModel):
        def forward(self, batch):
            loss = super().forward(batch)
            empty = torch.zeros(0)
            return {"loss": loss, "masked_acc": empty.mean(), "ok": torch.tensor(True)}

    trainer = make_trainer(model=MaskedAccuracy(), max_iters=4, log_period=2, accumulation_steps=2)
    trainer.train()
    storage = trainer.metric_storage
    assert storage["masked_acc"].count == 4 and math.isnan(storage["masked_acc"].latest)
    assert "ok" not in storage  # a bool is no metric: summed with bool + it would log 0.5
    assert math.isfinite(storage["total_loss"].latest)

    class NaNLoss(MaskedAccuracy):
        def forward(self, batch):
            out = super().forward(batch)
            return {**out, "loss": out["loss"] * math.nan}

    trainer = make_trainer(model=NaNLoss(), max_iters=4, log_period=2, work_dir=tmp_path / "nan")
    with pytest.raises(FloatingPointError, match=r"iteration 1 .*'total_loss': nan"):
        trainer.train()


def test_an_eval_metric_named_loss_beside_a_model_output_with_a_loss(make_trainer):
    class Output(LossAndOutputs):
        def forward(self, batch):
            return HuggingFaceLike(super().forward(batch))

    def metric_fn(model, batch):  # as transformers' Trainer names it before its eval_ prefix
        x, y = batch
        return {"loss": (model.linear(x) - y).pow(2).mean(1)}

    trainer = make_trainer(model=Output(), max_iters=4, log_period=2)
    trainer.register_hook(EvalHook(2, data_loader=tiny_loader(), metric_fn=metric_fn))
    trainer.train()
    storage = trainer.metric_storage
    assert storage["loss"].count == 2 and storage["total_loss"].count == 4


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


class LossAndAccuracy(TinyModel):
    """Returns its loss and, as MMEngine models often do, a metric that needs no gradient."""

    def forward(self, batch):
        x, y = batch
        pred = self.linear(x)
        with torch.no_grad():
            close = ((pred - y).abs() < 0.5).float().mean()
        return {"loss_mse": nn.functional.mse_loss(pred, y), "close": close}


def test_values_without_a_gradient_are_logged_not_added_to_the_loss(make_trainer, tmp_path):
    trainer = make_trainer(model=LossAndAccuracy(), max_epochs=1, log_period=1)
    trainer.train()
    storage = trainer.metric_storage
    assert storage["total_loss"].latest == storage["loss_mse"].latest
    assert 0.0 <= storage["close"].latest <= 1.0 and "close" in storage

    # the same weights as a model that returns its loss alone: what is backpropagated is the
    # loss, whole (not, say, a mean over the dict's values, which would halve its gradients)
    class LossAlone(LossAndAccuracy):
        def forward(self, batch):
            return super().forward(batch)["loss_mse"]

    alone = make_trainer(model=LossAlone(), max_epochs=1, work_dir=tmp_path / "alone")
    alone.train()
    for key, value in weights(alone).items():
        assert torch.equal(value, weights(trainer)[key])


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
    assert trainer.run_config["amp_dtype"] == "bfloat16"
    trainer.train()
    assert seen[0] == (True, torch.bfloat16)
    assert "amp_skipped_steps" not in trainer.metric_storage  # bfloat16 needs no scaler


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
            skipped.append(bool(self.metric_storage["amp_skipped_steps"].latest))
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


def test_compute_losses_runs_the_model_under_autocast_and_sums_a_dict(make_trainer, tmp_path):
    seen = []

    class TwoLosses(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x, y):  # called as model(**batch)
            out = self.linear(x)
            seen.append(out.dtype)
            return {"mse": nn.functional.mse_loss(out.float(), y), "l1": out.float().abs().mean()}

    batch = {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}
    for amp, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        trainer = make_trainer(model=TwoLosses(), unpack_batch_dict=True, enable_amp=amp,
                               loader=[batch], work_dir=tmp_path / f"amp_{amp}")  # fmt: skip
        loss, logged = trainer.compute_losses(batch)
        assert seen.pop() == dtype
        assert set(logged) == {"mse", "l1", "total_loss"}
        assert torch.equal(loss.detach(), logged["mse"] + logged["l1"])
        assert not any(v.requires_grad for v in logged.values()) and loss.requires_grad


class ComputeLossesStep(Trainer):
    """The plain built-in step written with compute_losses."""

    def train_one_iter(self):
        self.optimizer.zero_grad(set_to_none=True)
        loss, losses = self.compute_losses(self.next_batch())
        self.backward(loss)
        self.clip_and_step()
        self.log_losses(**losses)


def test_an_override_with_compute_losses_trains_as_the_built_in_step(tmp_path):
    builtin = build(tmp_path / "builtin", max_epochs=2, enable_amp=True)  # bfloat16
    builtin.train()
    override = build(tmp_path / "override", max_epochs=2, enable_amp=True, cls=ComputeLossesStep)
    override.train()
    a, b = weights(builtin), weights(override)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sums = [t.metric_storage["total_loss"].global_sum for t in (builtin, override)]
    assert sums[0] == sums[1]


def test_a_closure_optimizer_is_refused_pointing_at_an_override_that_works(tmp_path):
    model = TinyModel()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with pytest.raises(TypeError, match=r"optimizer LBFGS needs a closure.*docs/loop\.md"):
        Trainer(model, lbfgs, None, tiny_loader(), max_epochs=1, work_dir=tmp_path)
    # the override docs/loop.md shows, as written
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "loop.md")) as f:
        override = re.search(r"```python\n(class ClosureTrainer.*?)\n\n\nlbfgs", f.read(), re.S)
    namespace = {"Trainer": Trainer}
    exec(override[1], namespace)
    trainer = namespace["ClosureTrainer"](
        model, lbfgs, None, tiny_loader(), max_epochs=2, log_period=1, work_dir=tmp_path
    )
    trainer.train()
    losses = trainer.metric_storage["total_loss"]
    assert losses.count == 16 and math.isfinite(losses.latest)


def test_an_override_steps_one_optimizer_twice_with_float16(make_trainer):
    class TwoSteps(Trainer):  # a critic stepped twice per iteration, as in a WGAN
        def train_one_iter(self):
            for _ in range(2):
                self.optimizer.zero_grad()
                self.backward(self.model(self.next_batch()))
                self.clip_and_step()
                self.update_scaler()  # before the next step of the same optimizer

    trainer = make_trainer(
        cls=TwoSteps, enable_amp=True, amp_dtype=torch.float16, max_iters=3, clip_grad_norm=1.0
    )
    trainer.train()
    # one scale update per step, none left for the trainer to make twice
    assert trainer.grad_scaler.state_dict()["_growth_tracker"] == 6


class TwoOptimizersAndSchedules(Trainer):
    """A GAN-like override (docs/loop.md): the weight steps with the trainer's optimizer, the bias
    with a registered second one whose LR schedule the override steps per iteration."""

    def __init__(self, model, loader, **kwargs):
        weight_opt = torch.optim.SGD([model.linear.weight], lr=0.1, momentum=0.9)
        super().__init__(model, weight_opt, None, loader, clip_grad_norm=0.5, **kwargs)
        self.opt_b = torch.optim.SGD([model.linear.bias], lr=0.05, momentum=0.9)
        self.sched_b = torch.optim.lr_scheduler.ExponentialLR(self.opt_b, gamma=0.5)
        self.checkpointer.register("optimizer_b", self.opt_b)
        self.checkpointer.register("lr_scheduler_b", self.sched_b)
        self.norms = []  # (the weight's, the bias's): device tensors, read after training

    def train_one_iter(self):
        self.optimizer.zero_grad()
        self.opt_b.zero_grad()
        loss = self.model(self.next_batch())
        self.backward(loss)
        norms = (self.clip_and_step(self.opt_b), self.clip_and_step())
        self.norms.append(norms)
        self.log_losses(total_loss=loss.detach())
        self.log(self.cur_iter, lr_b=self.sched_b.get_last_lr()[0])  # smoothed by default
        self.sched_b.step()


def two_optimizers(work_dir, hooks=(), **kwargs):
    torch.manual_seed(0)
    loader = list(tiny_loader())  # 8 batches; a list: no DataLoader seed read at a pass's start
    trainer = TwoOptimizersAndSchedules(
        TinyModel(), loader, work_dir=work_dir, log_period=4, **kwargs
    )
    trainer.register_hooks(list(hooks))
    return trainer


def rows(trainer):
    with open(os.path.join(trainer.work_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_an_override_clipping_with_clip_and_step_logs_exact_grad_norms_without_a_sync(
    tmp_path, monkeypatch, caplog
):
    reads = count_host_reads(monkeypatch)
    per_iter = {}

    class Reads(HookBase):
        priority = 6  # right after TimerHook: brackets train_one_iter and the log point

        def before_iter(self):
            self.start = len(reads)

        def after_iter(self):
            per_iter[self.trainer.cur_iter + 1] = len(reads) - self.start

    caplog.set_level(logging.INFO, logger="trainer")
    trainer = two_optimizers(tmp_path, [Reads()], max_epochs=1, checkpoint_period=0)
    trainer.train()
    monkeypatch.undo()
    # no host read but at the log points, after iterations 4 and 8
    assert {n: r for n, r in per_iter.items() if r} == {4: per_iter[4], 8: per_iter[8]}
    norms = [(b.item(), w.item()) for b, w in trainer.norms]
    lrs = [0.05 * 0.5**i for i in range(8)]
    got = [
        {k: v for k, v in r.items() if k not in ("data_time", "iter_time")} for r in rows(trainer)
    ]
    assert got == [
        {"iter": n, "epoch": 1, "grad_norm": norms[n - 1][1],
         "grad_norm/optimizer_b": norms[n - 1][0], "lr_b": lrs[n - 1], "lr": 0.1,
         "total_loss": trainer.metric_storage["total_loss"].state_dict()["window"][n - 1]}
        for n in (4, 8)
    ]  # fmt: skip
    assert max(w for _, w in norms) > 0.5  # it did clip
    acc = EventAccumulator(trainer.tb_log_dir)
    acc.Reload()
    as_float32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    assert [(e.step, e.value) for e in acc.Scalars("train/lr_b")] == [
        (4, as_float32(lrs[3])), (8, as_float32(lrs[7]))
    ]  # fmt: skip
    assert [(e.step, e.value) for e in acc.Scalars("train/grad_norm/optimizer_b")] == [
        (4, as_float32(norms[3][0])), (8, as_float32(norms[7][0]))
    ]  # fmt: skip
    # the console line shows lr_b smoothed: the mean of the window (all 8 values)
    assert (
        f"lr_b {sum(lrs) / 8:.4g}" in caplog.text and f"lr_b {sum(lrs[:4]) / 4:.4g}" in caplog.text
    )


def test_clip_and_step_refuses_an_optimizer_no_checkpoint_holds(tmp_path):
    class Unregistered(TwoOptimizersAndSchedules):
        def __init__(self, model, loader, **kwargs):
            super().__init__(model, loader, **kwargs)
            self.opt_b = torch.optim.SGD([model.linear.bias], lr=0.05)  # in place of the one
            # registered: nothing would resume it, and two such would log one grad_norm/SGD

    torch.manual_seed(0)
    trainer = Unregistered(TinyModel(), list(tiny_loader()), work_dir=tmp_path, max_iters=2)
    with pytest.raises(ValueError, match="This SGD is in no checkpoint: checkpointer.register"):
        trainer.train()


@pytest.mark.parametrize("how", ["stop", "crash"])
def test_a_second_schedule_stepped_by_an_override_resumes_bit_exact(tmp_path, how):
    """Stopped after iteration 6 and continued, or crashed after iteration 14 (its log point 12
    written) and resumed from epoch_1.pth: the weights, the second optimizer and the second
    schedule's LR are those of an uninterrupted run, and the files show each step once with the
    same values."""

    class Interrupt(HookBase):
        def after_iter(self):
            if how == "stop" and self.trainer.cur_iter + 1 == 6:
                self.trainer.stop()
            if how == "crash" and self.trainer.cur_iter + 1 == 14:
                raise KeyboardInterrupt

    whole = two_optimizers(tmp_path / "whole", max_epochs=3)
    whole.train()
    cut = two_optimizers(tmp_path / "cut", [Interrupt()], max_epochs=3)
    if how == "stop":
        cut.train()
    else:
        with pytest.raises(SystemExit):
            cut.train()
    resumed = two_optimizers(tmp_path / "cut", max_epochs=3)
    resumed.train(continue_after_stop=True)
    assert resumed.start_iter == (6 if how == "stop" else 8)
    a, b = weights(whole), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.sched_b.get_last_lr() == resumed.sched_b.get_last_lr() == [0.05 * 0.5**24]
    assert whole.opt_b.param_groups[0]["lr"] == resumed.opt_b.param_groups[0]["lr"]
    momenta = [t.opt_b.state[t.model.linear.bias]["momentum_buffer"] for t in (whole, resumed)]
    assert torch.equal(*momenta)

    def untimed(trainer):
        times = {"data_time", "iter_time"}
        return [{k: v for k, v in r.items() if k not in times} for r in rows(trainer)]

    steps = [4, 6, 8, 12, 16, 20, 24] if how == "stop" else [4, 8, 12, 16, 20, 24]
    assert [r["iter"] for r in rows(resumed)] == steps
    if how == "stop":  # the stopped run wrote what it had logged since step 4, at its last step
        row_6 = untimed(resumed).pop(1)
        assert row_6["iter"] == 6 and row_6["lr_b"] == 0.05 * 0.5**5
    assert [r for r in untimed(resumed) if r["iter"] != 6] == untimed(whole)
    scalars = []
    for trainer in (whole, resumed):
        acc = EventAccumulator(trainer.tb_log_dir)
        acc.Reload()
        tags = [t for t in acc.Tags()["scalars"] if not t.startswith("time/")]
        scalars.append({t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags})
    assert [step for step, _ in scalars[1]["train/lr_b"]] == steps
    resumed_but_6 = {t: [(s, v) for s, v in pairs if s != 6] for t, pairs in scalars[1].items()}
    assert resumed_but_6 == scalars[0]
