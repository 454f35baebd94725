import io

import pytest
import torch

from trainer import HistoryBuffer, MetricStorage


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
