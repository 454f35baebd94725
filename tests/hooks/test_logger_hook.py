import logging
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.hooks import EvalHook


def read_scalars(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_are_written_at_log_points(make_trainer):
    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.register_hook(EvalHook(1, lambda: {"val_acc": 0.25 * (trainer.cur_epoch + 1)}))
    trainer.train()
    scalars = read_scalars(trainer.tb_log_dir)
    assert {"lr", "total_loss", "data_time", "iter_time", "val_acc"} <= set(scalars)
    assert [step for step, _ in scalars["total_loss"]] == [3, 7, 11, 15]
    assert scalars["val_acc"] == [(7, 0.25), (15, 0.5)]
    assert scalars["lr"][-1] == (15, pytest.approx(0.05))  # StepLR halves after epoch 1
    last = trainer.metric_storage["total_loss"].avg
    assert scalars["total_loss"][-1][1] == pytest.approx(last, rel=1e-6)


def test_console_and_log_file_lines(make_trainer, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="trainer")
    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.hooks.logger_hook"]
    progress = [line for line in lines if line.startswith("epoch")]
    assert len(progress) == 4
    pattern = (
        r"epoch 2/2 \[8/8\]  iter 16/16  ETA 0:00:00  lr 0\.05  total_loss [\d.e-]+  "
        r"data_time [\d.e-]+  iter_time [\d.e-]+"
    )
    assert re.fullmatch(pattern, progress[-1]), progress[-1]
    log_text = (tmp_path / "work" / "log.txt").read_text()
    assert progress[-1] in log_text
    assert "Training ran for" in log_text
