"""core-pytorch-utils (``cpu``) users switch by changing the import: its public names, module
paths and hook helpers work here as they do there."""

import logging

import pytest
import torch

import trainer
from trainer import HookBase, setup_logger

CPU_NAMES = [
    "EvalHook", "CheckpointHook", "LoggerHook", "LRUpdateHook", "DistributedHook", "HookBase",
    "init_distributed", "get_rank", "get_world_size", "is_main_process", "gather", "all_gather",
    "reduce_dict", "setup_logger", "set_random_seed", "collect_env", "HistoryBuffer",
    "MetricStorage", "LRWarmupScheduler", "Trainer",
]  # fmt: skip


def test_every_cpu_name_imports_from_the_package():
    missing = [name for name in CPU_NAMES if name not in trainer.__all__]
    assert not missing
    for name in CPU_NAMES:
        assert getattr(trainer, name) is not None


def test_cpu_module_paths_map():
    from trainer.distributed import all_gather, gather, init_distributed, reduce_dict  # noqa: F401
    from trainer.history_buffer import HistoryBuffer
    from trainer.hooks import CheckpointHook, EvalHook  # noqa: F401
    from trainer.logger import setup_logger as module_setup_logger
    from trainer.lr_scheduler import LRWarmupScheduler  # noqa: F401
    from trainer.metric_storage import MetricStorage  # noqa: F401
    from trainer.misc import collect_env, set_random_seed
    from trainer.trainer import Trainer

    assert Trainer is trainer.Trainer and HistoryBuffer is trainer.HistoryBuffer
    assert (collect_env, set_random_seed) == (trainer.collect_env, trainer.set_random_seed)
    assert module_setup_logger is setup_logger


def test_a_cpu_style_hook_and_train_by_epoch(make_trainer):
    seen = []

    class CpuStyle(HookBase):
        def after_iter(self):
            self.log(self.trainer.cur_iter, doubled=2.0 * self.trainer.cur_iter, smooth=False)

        def after_epoch(self):
            seen.append((self.class_name, self.metric_storage["doubled"].latest))

    epochs = make_trainer(max_epochs=2)
    epochs.register_hook(CpuStyle())
    epochs.train()
    assert epochs.train_by_epoch and not make_trainer(max_iters=5).train_by_epoch
    assert seen == [("CpuStyle", 14.0), ("CpuStyle", 30.0)]


def test_setup_logger_accepts_cpus_argument_names(tmp_path):
    log = setup_logger("cpu_style", output_dir=str(tmp_path), log_level=logging.DEBUG, color=True)
    log.debug("debug reaches the file")
    for handler in log.handlers:
        handler.flush()
    assert log.level == logging.DEBUG
    assert "debug reaches the file" in (tmp_path / "log.txt").read_text()
    with pytest.raises(ValueError, match="Pass output or output_dir"):
        setup_logger("cpu_style", output="a", output_dir="b")


def test_history_buffer_and_storage_behave_as_cpus():
    storage = trainer.MetricStorage()
    storage.update(0, loss=1.0)
    storage.update(1, loss=3.0)
    assert storage["loss"].avg == 2.0 and storage["loss"].global_avg == 2.0
    assert torch.equal(torch.tensor(storage["loss"].latest), torch.tensor(3.0))
