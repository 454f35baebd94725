from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import writers
from trainer.writers import TensorBoardWriter


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now

    def time(self):
        return 1_000_000.0 + self.now


def test_tensorboard_events_are_handed_over_in_batches_with_their_own_wall_time(
    tmp_path, monkeypatch
):
    clock = Clock()
    monkeypatch.setattr(writers, "time", clock)
    writer = TensorBoardWriter(str(tmp_path), handoff_secs=5.0)
    handed = []
    real_add = writer._writer.file_writer.add_summary
    monkeypatch.setattr(
        writer._writer.file_writer, "add_summary",
        lambda summary, step, wall_time: handed.append((step, wall_time)) or real_add(
            summary, step, wall_time),
    )  # fmt: skip
    for step in range(3):  # 3 log points within 5 s: kept back
        writer.write(None, step, {"loss": float(step), "lr": 0.1})
        clock.now += 1.0
    assert handed == []
    clock.now += 3.0  # 6 s after the last hand-over: this write hands all four over
    writer.write(None, 3, {"loss": 3.0, "lr": 0.1})
    assert handed == [(0, 1_000_100.0), (1, 1_000_101.0), (2, 1_000_102.0), (3, 1_000_106.0)]
    writer.write(None, 4, {"loss": 4.0, "lr": 0.1})
    assert len(handed) == 4
    writer.close()  # hands over the rest
    assert handed[-1] == (4, 1_000_106.0)

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(s, float(s)) for s in range(5)]
    assert [e.wall_time for e in acc.Scalars("lr")] == [w for _, w in handed]
