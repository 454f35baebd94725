"""The Trainer's argument checks (trainer/arguments.py): errors have the right type and name the
argument and the key fact; options of a default hook act or are refused."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from trainer import LRWarmupScheduler, Trainer
from trainer.hooks import CheckpointHook, LoggerHook

from conftest import TinyModel, tiny_dataset, tiny_loader


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"max_epochs": 2, "max_iters": 5},
            ValueError,
            r"Pass one of .*got max_epochs=2, max_iters=5",
        ),
        (
            {"max_epochs": 0},
            ValueError,
            r"Pass one of .*got max_epochs=0, max_iters=0",
        ),
        ({"max_epochs": -1}, ValueError, r"max_epochs .*got -1"),
        ({"max_epochs": 1.5}, TypeError, r"max_epochs .*got float 1.5"),
        ({"log_period": 0}, ValueError, r"log_period .*got 0"),
        ({"accumulation_steps": 0}, ValueError, r"accumulation_steps .*got 0"),
        ({"max_num_checkpoints": 0}, ValueError, r"max_num_checkpoints .*got 0"),
        ({"clip_grad_norm": -1.0}, ValueError, r"clip_grad_norm must be >= 0"),
        ({"enable_amp": torch.float64}, ValueError, r"enable_amp .*torch.bfloat16"),
        ({"warmup_init_lr": -0.1}, ValueError, r"^warmup_init_lr must be .*>= 0.*got -0.1"),
        ({"warmup_factor": 5.0}, ValueError, r"^warmup_factor must be in \[0, 1\].*got 5.0"),
        ({"accumulation_steps": 9}, ValueError, r"8 batches, fewer than accumulation_steps"),
    ],
)
def test_bad_arguments_raise_clear_errors(make_trainer, kwargs, error, message):
    with pytest.raises(error, match=message):
        make_trainer(**kwargs)


@pytest.mark.parametrize(
    "name, value, got",
    [
        ("clip_grad_norm", "1.0", "str"),
        ("clip_grad_norm", None, "NoneType"),
        ("log_period", "50", "str"),
        ("checkpoint_period", 1.0, "float"),
        ("max_num_checkpoints", "3", "str"),
        ("accumulation_steps", True, "bool"),
        ("preempt_check_period", None, "NoneType"),
        ("warmup_t", 0.5, "float"),
        ("enable_amp", "yes", "str"),
        ("unpack_batch_dict", 1, "int"),
        ("by_epoch", None, "NoneType"),
        ("warmup_by_epoch", 0, "int"),
        ("cuda_graph", None, "NoneType"),
        ("warmup_mode", 1, "int"),
        ("warmup_init_lr", "0", "str"),
        ("warmup_factor", None, "NoneType"),
    ],
)
def test_every_argument_type_error_names_the_argument(make_trainer, name, value, got):
    with pytest.raises(TypeError, match=rf"^{name} must be .*got {got}"):
        make_trainer(**{name: value})


def test_bad_types_raise_type_errors(tmp_path):
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="^model .*got str"):
        Trainer("model", opt, None, tiny_loader(), max_epochs=1, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="^optimizer .*got NoneType"):
        Trainer(model, None, None, tiny_loader(), max_epochs=1, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="^lr_scheduler .*got str"):
        Trainer(model, opt, "cosine", tiny_loader(), max_epochs=1, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="^work_dir .*got int 3"):
        Trainer(model, opt, None, tiny_loader(), max_epochs=1, work_dir=3)


@pytest.mark.parametrize("work_dir", ["", "  ", "\t\n"])
def test_a_blank_work_dir_is_refused_before_anything_is_written(
    make_trainer, tmp_path, monkeypatch, work_dir
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^work_dir is blank") as error:
        make_trainer(work_dir=work_dir)
    assert repr(work_dir) in str(error.value)
    assert os.listdir(tmp_path) == []
    make_trainer(work_dir=".")  # the current directory, said so
    assert os.listdir(tmp_path) == ["checkpoints"]


def test_an_empty_data_loader_and_max_epochs_over_a_stream_are_refused(make_trainer):
    with pytest.raises(ValueError, match="data_loader is empty"):
        make_trainer(loader=DataLoader(tiny_dataset(0), batch_size=4))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from tiny_dataset()

    with pytest.raises(ValueError, match="max_epochs needs a data_loader with a length"):
        make_trainer(loader=DataLoader(Stream(), batch_size=4), max_epochs=2)


def test_unwritable_work_dir_fails_at_construction(make_trainer, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    with pytest.raises(PermissionError, match="is not writable"):
        make_trainer(work_dir=locked)


@pytest.mark.parametrize("option", [{"warmup_t": 5}, {"by_epoch": False}, {"warmup_mode": "auto"}])
def test_warmup_options_with_an_lr_warmup_scheduler_are_refused(make_trainer, option):
    def wrapped(optimizer):
        return LRWarmupScheduler(None, optimizer=optimizer, warmup_t=3)

    name, value = next(iter(option.items()))
    with pytest.raises(ValueError, match=rf"LRWarmupScheduler: pass {name}={value!r}"):
        make_trainer(scheduler=wrapped, **option)
    assert make_trainer(scheduler=wrapped).lr_scheduler.warmup_t == 3  # used as given


def test_checkpoint_options_without_checkpoints_are_refused(make_trainer):
    with pytest.raises(ValueError, match="checkpoint_period=0 .*max_num_checkpoints"):
        make_trainer(checkpoint_period=0, max_num_checkpoints=2)


@pytest.mark.parametrize(
    "option",
    [
        "amp_dtype",
        "plateau_metric",
        "checkpoint_by_epoch",
        "metric_writers",
        "tensorboard",
        "metrics_jsonl",
        "compile",
        "progress_bar",
    ],
)
def test_options_of_one_hook_or_of_torch_are_not_trainer_arguments(tmp_path, option):
    """Issue 31: what configures one default hook is that hook's argument (replace the hook),
    torch.compile is the user's call, and enable_amp takes the AMP dtype."""
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{option}'"):
        Trainer(model, optimizer, None, tiny_loader(), max_epochs=1, **{option: None})


@pytest.mark.parametrize(
    "hook, name",
    [(CheckpointHook, "by_epoch"), (LoggerHook, "tensorboard"), (LoggerHook, "metrics_jsonl")],
)
def test_a_default_hooks_flag_given_as_a_string_is_refused(hook, name):
    """Issue 48: CheckpointHook(by_epoch="no") counted as True, and saved by epoch."""
    with pytest.raises(TypeError, match=rf"^{name} must be True or False, got str 'no'"):
        hook(**{name: "no"})
    hook(**{name: False})


def test_an_optimizer_over_another_models_parameters_is_refused(tmp_path):
    model, other = TinyModel(), TinyModel()
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer holds 2 parameters not the model's"):
        Trainer(model, optimizer, None, tiny_loader(), max_epochs=1, work_dir=tmp_path)


def test_a_scheduler_of_another_optimizer_is_refused(tmp_path):
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stray = torch.optim.SGD(model.parameters(), lr=0.1)
    for scheduler in (
        torch.optim.lr_scheduler.StepLR(stray, 1),
        torch.optim.lr_scheduler.ReduceLROnPlateau(stray),
        LRWarmupScheduler(torch.optim.lr_scheduler.StepLR(stray, 1), epoch_len=8),
    ):
        with pytest.raises(ValueError, match="lr_scheduler schedules another optimizer"):
            Trainer(model, optimizer, scheduler, tiny_loader(), max_epochs=1, work_dir=tmp_path)


def test_trainable_parameters_in_no_optimizer_are_warned_about(tmp_path, caplog):
    model = TinyModel()
    model.extra = torch.nn.Linear(2, 2)  # trainable, in no optimizer
    optimizer = torch.optim.SGD(model.linear.parameters(), lr=0.1)
    Trainer(model, optimizer, None, tiny_loader(), max_epochs=1, work_dir=tmp_path).train()
    assert "2 trainable parameters" in caplog.text and "extra.weight, extra.bias" in caplog.text
    caplog.clear()
    model.extra.requires_grad_(False)  # frozen on purpose: nothing to say
    Trainer(model, optimizer, None, tiny_loader(), max_epochs=2, work_dir=tmp_path).train()
    assert "in no optimizer" not in caplog.text


def test_batches_that_accumulation_leaves_over_are_named_once_at_the_start(tmp_path, caplog):
    class Stream(torch.utils.data.IterableDataset):  # 33 batches of 4, without a length
        def __iter__(self):
            return iter(tiny_dataset(132))

    def train(loader, accumulation_steps, name, **length):
        model = TinyModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        Trainer(
            model,
            optimizer,
            None,
            loader,
            accumulation_steps=accumulation_steps,
            work_dir=tmp_path / name,
            **(length or {"max_epochs": 2}),
        ).train()
        return [r.getMessage() for r in caplog.records if "left over" in r.getMessage()]

    said = train(tiny_loader(132), 2, "33")  # the 33rd batch of each epoch is drawn and dropped
    assert len(said) == 1
    assert "33 batches per epoch, accumulation_steps=2: the last batch" in said[0]
    assert "multiple of 2" in said[0]
    caplog.clear()
    said = train(tiny_loader(140), 4, "35")
    assert len(said) == 1 and "35 batches" in said[0] and "the last 3 of each epoch" in said[0]
    caplog.clear()
    assert train(tiny_loader(128), 2, "32") == []  # 32 batches: accumulation 2 divides them
    assert train(tiny_loader(132), 1, "no accumulation") == []
    assert train(DataLoader(Stream(), batch_size=4), 2, "stream", max_iters=20) == []
