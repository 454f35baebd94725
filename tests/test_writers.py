import os
import socket
import time
import types

import pytest
import torch
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
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (s, float(s)) for s in range(5)
    ]
    assert [e.wall_time for e in acc.Scalars("train/lr")] == [w for _, w in handed]


def test_a_new_run_replaces_the_trainers_old_events_whatever_their_names_sort_as(tmp_path):
    # TensorBoard reads event files in name order; an old run's file from this very second whose
    # counter sorts after the new one's (9 after 10) would be read last and its curves kept
    old = TensorBoardWriter(str(tmp_path))
    for step in range(1, 5):
        old.write(None, step, {"loss": 1.0})
    old.close()
    (old_file,) = os.listdir(tmp_path)
    assert old_file.endswith(".trainer")
    # as if made in the coming second, by this process, with a counter that sorts last
    old_name = f"events.out.tfevents.{int(time.time()) + 1}.{socket.gethostname()}.{os.getpid()}"
    os.rename(tmp_path / old_file, tmp_path / f"{old_name}.z.trainer")
    new = TensorBoardWriter(str(tmp_path), start_iter=0)
    new.write(None, 1, {"loss": 2.0})
    new.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0)]
    assert len(os.listdir(tmp_path)) == 1  # the old file, left without events, is gone


def test_a_resumed_run_keeps_the_steps_before_it_and_other_writers_events(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    old = TensorBoardWriter(str(tmp_path))
    for step in range(1, 7):  # steps count the iterations done
        old.write(None, step, {"loss": float(step)})
    old.close()
    own = SummaryWriter(str(tmp_path))  # a user's writer in the same folder
    own.add_histogram("weights", torch.arange(4.0), 5)
    own.close()
    resumed = TensorBoardWriter(str(tmp_path), start_iter=3)  # after 3 iterations
    resumed.write(None, 4, {"loss": 40.0})
    resumed.write(None, 5, {"loss": 50.0})
    resumed.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    steps = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert steps == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert [e.step for e in acc.Histograms("weights")] == [5]


def test_files_a_resumed_run_rewrites_keep_the_permissions_open_gives(tmp_path):
    """Rewritten through a temporary file (0o600), they stayed private to the user."""
    umask = os.umask(0o022)
    try:
        old = TensorBoardWriter(str(tmp_path / "tb"))
        rows = writers.JSONLinesWriter(str(tmp_path / "metrics.jsonl"))
        for step in range(1, 7):
            old.write(None, step, {"loss": float(step)})
            rows.write(types.SimpleNamespace(cur_epoch=0), step, {"loss": float(step)})
        old.close()
        rows.close()
        TensorBoardWriter(str(tmp_path / "tb"), start_iter=4).close()
        writers.JSONLinesWriter(str(tmp_path / "metrics.jsonl"), start_iter=4).close()
    finally:
        os.umask(umask)
    rewritten, new = sorted(os.listdir(tmp_path / "tb"))  # no temporary file left either
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "tb"]
    for path in (tmp_path / "tb" / rewritten, tmp_path / "tb" / new, tmp_path / "metrics.jsonl"):
        assert os.stat(path).st_mode & 0o777 == 0o644, path
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_resumed_runs_event_file_sorts_after_the_old_ones(tmp_path):
    # TensorBoard reads event files in name order: the old steps must come first
    old = TensorBoardWriter(str(tmp_path))
    for step in range(1, 7):  # steps count the iterations done
        old.write(None, step, {"loss": float(step)})
    old.close()
    (old_file,) = os.listdir(tmp_path)
    # as if made in this second, by this process, with a counter that sorts last
    old_name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.z"
    os.rename(tmp_path / old_file, tmp_path / f"{old_name}.trainer")
    resumed = TensorBoardWriter(str(tmp_path), start_iter=3)
    resumed.write(None, 4, {"loss": 40.0})
    resumed.close()
    assert sorted(os.listdir(tmp_path))[0] == f"{old_name}.trainer"
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    steps = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert steps == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_tensorboard_events_are_not_written_through_a_linked_folder(tmp_path):
    # a rerun rewrites the event files of its folder: one linked elsewhere stays untouched
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "events.out.tfevents.1.host.1.trainer").write_bytes(b"theirs")
    os.symlink(tmp_path / "elsewhere", tmp_path / "tb_logs")
    with pytest.raises(RuntimeError, match="tb_logs is a symbolic link .* remove it"):
        TensorBoardWriter(str(tmp_path / "tb_logs"))
    assert os.listdir(tmp_path / "elsewhere") == ["events.out.tfevents.1.host.1.trainer"]
