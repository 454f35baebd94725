"""HistoryBuffer, MetricStorage, and the pending metrics: kept on the device until a log point,
NaN-checked there."""

import io
import math
import os
import re

import numpy as np
import pytest
import torch

from trainer import HistoryBuffer, HookBase, MetricStorage

from conftest import TinyModel, count_host_reads


def test_history_buffer_statistics():
    buf = HistoryBuffer(window_size=3)
    for v in [1.0, 2.0, 3.0, 10.0]:
        buf.update(v)
    assert buf.latest == 10.0
    assert buf.avg == pytest.approx(5.0)  # mean of the last 3
    assert buf.global_avg == pytest.approx(4.0)
    assert buf.global_sum == 16.0
    assert buf.count == 4


def test_history_buffer_rejects_bad_window():
    with pytest.raises(ValueError, match="window_size must be a positive int, got 0"):
        HistoryBuffer(window_size=0)
    with pytest.raises(TypeError, match="window_size must be a positive int, got float 2.0"):
        HistoryBuffer(window_size=2.0)
    with pytest.raises(ValueError, match="window_size must be a positive int, got 0"):
        MetricStorage(window_size=0)


def test_storage_is_a_mapping_with_smoothing():
    storage = MetricStorage(window_size=2)
    storage.update(iter=0, loss=3.0)
    storage.update(iter=1, loss=1.0, acc=0.5)
    storage.update(iter=2, acc=0.75, smooth=True)
    storage.update(iter=5, top1=0.9, smooth=False)
    storage.update(iter=6, top1=0.8, smooth=False)
    assert "loss" in storage and "missing" not in storage
    assert set(storage) == {"loss", "acc", "top1"} and len(storage) == 3
    assert storage["loss"].global_avg == 2.0
    assert storage.values_maybe_smooth == {
        "loss": (1, 2.0),
        "acc": (2, 0.625),
        "top1": (6, 0.8),
    }


def test_storage_counts_iterations_when_none_given():
    storage = MetricStorage()
    storage.update(loss=1.0)
    storage.update(loss=2.0)
    assert storage.latest_iter("loss") == 1


def test_storage_refuses_mixed_smoothing():
    storage = MetricStorage()
    storage.update(iter=0, acc=0.5, smooth=False)
    with pytest.raises(ValueError, match="'acc' was first logged with smooth=False"):
        storage.update(iter=1, acc=0.6, smooth=True)


def test_storage_state_round_trips_through_weights_only_load():
    storage = MetricStorage(window_size=2)
    for i in range(5):
        storage.update(iter=i, loss=float(i))
    storage.update(iter=4, acc=0.5, smooth=False)
    buffer = io.BytesIO()
    torch.save(storage.state_dict(), buffer)
    buffer.seek(0)
    restored = MetricStorage()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.values_maybe_smooth == storage.values_maybe_smooth
    assert restored["loss"].global_sum == 10.0
    restored.update(iter=5, loss=5.0)
    storage.update(iter=5, loss=5.0)
    assert restored["loss"].avg == storage["loss"].avg == 4.5


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
    # cur_iter 5 is iteration 6 of epoch 1, as the message names them
    with pytest.raises(FloatingPointError, match=r"NaN or infinite at iteration 6 \(epoch 1\)"):
        trainer.train()
    assert reached == list(range(7))  # raised at iteration 8 (cur_iter 7), the log point
    assert trainer.metric_storage["total_loss"].count == 5  # iterations 1-5 were recorded


@pytest.mark.parametrize(
    "index, named", [(0, "iteration 1 (epoch 1)"), (9, "iteration 10 (epoch 2)")]
)
def test_a_bad_loss_names_its_iteration_and_epoch_by_number_from_1(index, named):
    """cur_iter 0 is the first iteration, of the first epoch; with 8 per epoch, cur_iter 9 is
    the 10th iteration, the 2nd of epoch 2."""
    storage = MetricStorage(epoch_len=8)
    storage.add(index, {"loss": torch.tensor(math.nan)}, check_finite=True)
    with pytest.raises(FloatingPointError, match=re.escape(f"at {named}: {{'loss': nan}}")):
        storage.flush()


@pytest.mark.parametrize(
    "bad, named, fix",
    [
        (["loss"], "Loss", "Lower the LR, enable clip_grad_norm, or check"),
        (["grad_norm"], "The gradient norm (the loss was not)", "Lower the LR, or check"),
        (
            ["grad_norm/optimizer_d"],
            "The gradient norm grad_norm/optimizer_d (the loss was not)",
            "Lower the LR, or check",
        ),
        (
            ["loss", "grad_norm/optimizer_d"],
            "Loss",
            "Lower the LR, enable clip_grad_norm, or check",
        ),
    ],
)
def test_a_bad_gradient_norm_of_any_optimizer_is_named_as_a_norm(bad, named, fix):
    storage = MetricStorage()
    values = {"loss": 1.0, "grad_norm": 2.0, "grad_norm/optimizer_d": 3.0}
    values.update((name, math.nan) for name in bad)
    storage.add(2, {k: torch.tensor(v) for k, v in values.items()}, check_finite=True)
    expected = f"{named} became NaN or infinite at iteration 3: "
    with pytest.raises(FloatingPointError, match=re.escape(expected)) as error:
        storage.flush()
    assert str(error.value).endswith(f"{fix} the data of that iteration.")


def test_nan_loss_never_reaches_a_checkpoint(make_trainer):
    trainer = make_trainer(
        model=NaNAt(5), max_iters=20, log_period=10, checkpoint_period=2, checkpoint_by_epoch=False
    )
    with pytest.raises(FloatingPointError, match="iteration 6"):
        trainer.train()
    saved = sorted(os.listdir(trainer.ckpt_dir))
    assert saved == ["iter_2.pth", "iter_4.pth", "latest.txt"]
    with open(os.path.join(trainer.ckpt_dir, "latest.txt")) as f:
        assert f.read() == "iter_4.pth"


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


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("high", TypeError, "must be a number or a one-element tensor, not 'high'"),
        (None, TypeError, "must be a number or a one-element tensor, not None"),
        ([0.5], TypeError, "must be a number or a one-element tensor, not [0.5]"),
        (np.ones(3), TypeError, "must be a number or a one-element tensor, not array"),
        (
            torch.ones(2),
            ValueError,
            "must be a number or a one-element tensor, got torch.Size([2])",
        ),
        (torch.empty(3, device="meta"), ValueError, "is a tensor on the meta device"),
        (torch.empty((), device="meta"), ValueError, "is a tensor on the meta device"),
    ],
)
@pytest.mark.parametrize("how", [{}, {"reduce": True}, {"check_finite": True}])
def test_log_refuses_what_is_not_a_number_naming_the_metric(
    make_trainer, value, error, message, how
):
    trainer = make_trainer()
    with pytest.raises(error) as raised:  # at the call, not at the next log point
        trainer.log(0, acc=value, **how)
    assert str(raised.value).startswith(f"Metric 'acc' {message}")
    trainer.metric_storage.flush(every_rank=True)
    assert "acc" not in trainer.metric_storage


def test_log_takes_numbers_bools_numpy_scalars_and_one_element_tensors(make_trainer, monkeypatch):
    """Read as numbers at the log point; before it, log() reads no tensor's value (on a GPU, a
    sync): its checks look at the type, the shape and the device."""
    trainer = make_trainer()
    weight = trainer.model.linear.weight  # requires grad: logged detached
    reads = count_host_reads(monkeypatch)
    for it in range(3):
        trainer.log(it, grad=weight[0, 0] * 0 + it, column=torch.ones(1, 1) * it, reduce=True)
        trainer.log(it, flag=it == 1, np32=np.float32(0.5), np0d=np.array(2.0), n=torch.tensor(it))
    assert reads == []
    monkeypatch.undo()
    trainer.metric_storage.flush(every_rank=True)
    storage = trainer.metric_storage
    assert {name: storage[name].global_sum for name in storage} == {
        "grad": 3.0,
        "column": 3.0,
        "flag": 1.0,
        "np32": 1.5,
        "np0d": 6.0,
        "n": 3.0,
    }


def test_a_series_of_numbers_and_tensors_is_flushed_in_order(make_trainer):
    class Mixed(HookBase):
        def after_iter(self):
            it = self.trainer.cur_iter
            value = torch.tensor(float(it)) if it % 2 else float(it)  # alternately
            self.trainer.log(it, mixed=value, number=it * 10, smooth=False)

    trainer = make_trainer(max_epochs=1, log_period=4)
    trainer.register_hook(Mixed())
    trainer.train()
    storage = trainer.metric_storage
    assert storage["mixed"].count == 8 and storage["mixed"].global_sum == sum(range(8))
    assert storage["mixed"].latest == 7.0 and storage.latest_iter("mixed") == 7
    assert storage["number"].global_sum == 280.0


def test_history_buffer_extend_sums_as_one_by_one_updates():
    values = [0.1, 0.2, 0.3, 1e16, -1e16, 0.7]
    one_by_one, batched = HistoryBuffer(), HistoryBuffer()
    for v in values:
        one_by_one.update(v)
    batched.extend(values[:2])
    batched.extend(values[2:])
    assert batched.global_sum == one_by_one.global_sum  # bit for bit, not approximately
    assert batched.avg == one_by_one.avg and batched.count == one_by_one.count


def test_series_of_other_dtypes_flushed_together_keep_their_values():
    # stacked together, an int series would take the bfloat16 loss's type (12345 -> 12352)
    storage = MetricStorage()
    half = torch.tensor(0.5, dtype=torch.bfloat16)
    storage.add(0, {"tokens": torch.tensor(12345), "big": torch.tensor(100000), "loss": half})
    storage.flush()
    assert {name: storage[name].latest for name in storage} == {
        "tokens": 12345.0,
        "big": 100000.0,
        "loss": 0.5,
    }


def test_a_saved_buffer_with_a_bad_window_size_is_refused_at_load():
    storage = MetricStorage()
    storage.update(0, loss=1.0)
    state = storage.state_dict()
    state["metrics"]["loss"]["buffer"]["window_size"] = 0
    with pytest.raises(ValueError, match="window_size must be a positive int, got 0"):
        MetricStorage().load_state_dict(state)
