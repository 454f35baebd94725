import json
import os
import re

import torch

from trainer import HookBase, Trainer
from trainer.hooks import TimerHook

from conftest import FakeClock, TinyModel, read_scalars, tiny_loader


def rows(trainer):
    with open(os.path.join(trainer.work_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_logged_times_are_each_periods_own_mean(make_trainer, caplog, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("trainer.hooks.timer_hook.time", clock)

    class CompileFirst(HookBase):  # the first iteration takes 10 s, the others 1 s
        def after_iter(self):
            clock.now += 10.0 if self.trainer.cur_iter == 0 else 1.0

    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.register_hook(CompileFirst())
    trainer.train()
    # the clock moves after each log point's reading: (10 + 1 + 1) / 4, then 4 / 4
    expected = [(4, 3.0), (8, 1.0), (12, 1.0), (16, 1.0)]
    assert read_scalars(trainer.tb_log_dir)["time/iter_time"] == expected
    assert [(r["iter"], r["iter_time"]) for r in rows(trainer)] == expected
    shown = re.findall(r"iter (\d+)/16 .* iter_time (\S+ m?s)", caplog.text)
    assert shown == [("4", "3 s"), ("8", "1 s"), ("12", "1 s"), ("16", "1 s")]


def test_data_time_is_each_periods_mean_wait_for_batches(make_trainer, monkeypatch, caplog):
    clock = FakeClock()
    for module in ("trainer.data", "trainer.hooks.timer_hook", "trainer.hooks.logger_hook"):
        monkeypatch.setattr(f"{module}.time", clock)

    class SlowLoader:  # the first pass's batches take 2 s each, the second's 0.5 s
        def __init__(self, loader):
            self.loader, self.passes = loader, 0

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            self.passes += 1
            wait = 2.0 if self.passes == 1 else 0.5
            for batch in self.loader:
                clock.now += wait
                yield batch

    trainer = make_trainer(loader=SlowLoader(tiny_loader()), max_epochs=2, log_period=4)
    trainer.train()
    assert [(r["iter"], r["data_time"]) for r in rows(trainer)] == [
        (4, 2.0),
        (8, 2.0),
        (12, 0.5),
        (16, 0.5),
    ]
    assert trainer.data_seconds == 8 * 2.0 + 8 * 0.5
    assert re.search(r"data loading +20 s \(100.0%\)", caplog.text)  # all the run's time


def test_each_parameter_groups_lr_is_logged_exactly(tmp_path, caplog):
    """lr for the first group, lr/group1 for the second: the LR each used at the log point's
    iteration, in metrics.jsonl and TensorBoard; the console line shows lr alone."""
    caplog.set_level("INFO", logger="trainer")
    model = TinyModel()
    groups = [{"params": [model.linear.weight]}, {"params": [model.linear.bias], "lr": 0.01}]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)  # per iteration
    trainer = Trainer(
        model,
        optimizer,
        schedule,
        tiny_loader(),
        max_epochs=1,
        by_epoch=False,
        log_period=4,
        work_dir=tmp_path,
    )
    trainer.train()
    expected = {4: (0.1 * 0.5**3, 0.01 * 0.5**3), 8: (0.1 * 0.5**7, 0.01 * 0.5**7)}
    assert {r["iter"]: (r["lr"], r["lr/group1"]) for r in rows(trainer)} == expected
    scalars = read_scalars(trainer.tb_log_dir)
    as_float32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    assert scalars["train/lr"] == [(n, as_float32(lrs[0])) for n, lrs in expected.items()]
    assert scalars["train/lr/group1"] == [(n, as_float32(lrs[1])) for n, lrs in expected.items()]
    console = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 1/1")]
    assert len(console) == 2 and "  lr 0.0125  " in console[0]
    assert not any("group1" in line for line in console)


def test_without_it_the_logger_flushes_at_its_log_points_and_no_time_is_logged(make_trainer):
    trainer = make_trainer(max_epochs=1, log_period=4)
    trainer.unregister_hook(TimerHook)
    trainer.train()
    assert [sorted(r) for r in rows(trainer)] == [["epoch", "iter", "total_loss"]] * 2
    losses = trainer.metric_storage["total_loss"].state_dict()["window"]
    assert [r["total_loss"] for r in rows(trainer)] == [losses[3], losses[7]]
