"""The Trainer's argument checks (trainer/arguments.py): errors name the argument, what was
expected and what was received; options of a default hook act or are refused."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from trainer import LRWarmupScheduler, Trainer

from conftest import TinyModel, tiny_dataset, tiny_loader


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_epochs": 2, "max_iters": 5}, ValueError, r"exactly one of max_epochs or max_iters"),
        ({"max_epochs": 0}, ValueError, r"got max_epochs=0, max_iters=0"),
        ({"max_epochs": -1}, ValueError, r"max_epochs must be an int >= 0, got -1"),
        ({"max_epochs": 1.5}, TypeError, r"max_epochs must be an int >= 0, got float 1.5"),
        ({"log_period": 0}, ValueError, r"log_period must be a positive int, got 0"),
        ({"accumulation_steps": 0}, ValueError, r"accumulation_steps must be a positive int"),
        ({"max_num_checkpoints": 0}, ValueError, r"max_num_checkpoints must be a positive int"),
        ({"clip_grad_norm": -1.0}, ValueError, r"clip_grad_norm must be >= 0"),
        (
            {"enable_amp": torch.float64},
            ValueError,
            r"enable_amp must be True, False, torch.float16",
        ),
        ({"accumulation_steps": 9}, ValueError, r"8 batches, fewer than accumulation_steps=9"),
    ],
)
def test_bad_arguments_raise_clear_errors(make_trainer, kwargs, error, message):
    with pytest.raises(error, match=message):
        make_trainer(**kwargs)


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("clip_grad_norm", "1.0", "a number, got str '1.0'"),
        ("clip_grad_norm", None, "a number, got NoneType None"),
        ("log_period", "50", "a positive int, got str '50'"),
        ("checkpoint_period", 1.0, r"an int >= 0 \(0 disables\), got float 1.0"),
        ("max_num_checkpoints", "3", "a positive int, got str '3'"),
        ("accumulation_steps", True, "a positive int, got bool True"),
        ("preempt_check_period", None, "a positive int, got NoneType None"),
        ("warmup_t", 0.5, r"an int >= 0 \(0 disables warmup\), got float 0.5"),
        ("enable_amp", "yes", "True, False or a torch dtype, got str 'yes'"),
        ("unpack_batch_dict", 1, "True or False, got int 1"),
        ("by_epoch", None, "True or False"),
        ("warmup_by_epoch", 0, "True or False"),
        ("cuda_graph", None, "True or False"),
        ("warmup_mode", 1, "a str, got int 1"),
        ("warmup_init_lr", "0", "a number, got str '0'"),
        ("warmup_factor", None, "a number, got NoneType None"),
    ],
)
def test_every_argument_type_error_names_the_argument(make_trainer, name, value, expected):
    with pytest.raises(TypeError, match=rf"{name} must be {expected}"):
        make_trainer(**{name: value})


def test_bad_types_raise_type_errors(tmp_path):
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        Trainer("model", opt, None, tiny_loader(), max_epochs=1, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        Trainer(model, None, None, tiny_loader(), max_epochs=1, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="lr_scheduler must be"):
        Trainer(model, opt, "cosine", tiny_loader(), max_epochs=1, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="work_dir must be a str or os.PathLike path, got int 3"):
        Trainer(model, opt, None, tiny_loader(), max_epochs=1, work_dir=3)


@pytest.mark.parametrize(
    "work_dir, what",
    [
        ("", "is empty (''): the run's checkpoints and logs would go into the current directory"),
        ("  ", "is blank ('  '): the run's checkpoints and logs would go into a folder named by"),
        ("\t\n", "is blank ('\\t\\n'): the run's"),
    ],
)
def test_a_blank_work_dir_is_refused_before_anything_is_written(
    make_trainer, tmp_path, monkeypatch, work_dir, what
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        make_trainer(work_dir=work_dir)
    assert str(error.value).startswith(f"work_dir {what}")
    assert str(error.value).endswith(
        'Pass a folder name, e.g. work_dir="runs/exp1", or work_dir="." if the current directory '
        "is really meant."
    )
    assert os.listdir(tmp_path) == []
    make_trainer(work_dir=".")  # the current directory, said so
    assert os.listdir(tmp_path) == ["checkpoints"]


def test_an_empty_data_loader_and_max_epochs_over_a_stream_are_refused(make_trainer):
    with pytest.raises(ValueError, match="data_loader is empty"):
        make_trainer(loader=DataLoader(tiny_dataset(0), batch_size=4))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from tiny_dataset()

    with pytest.raises(ValueError) as error:  # its epochs have no length to count
        make_trainer(loader=DataLoader(Stream(), batch_size=4), max_epochs=2)
    assert str(error.value) == (
        "max_epochs=2 needs a data_loader with a length, and this one (a DataLoader over "
        "Stream) has none: it is a stream. Pass max_iters=N instead; an epoch is then one pass "
        "until the stream ends."
    )


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
    with pytest.raises(ValueError, match=rf"LRWarmupScheduler.*so {name}={value!r} would be"):
        make_trainer(scheduler=wrapped, **option)
    assert make_trainer(scheduler=wrapped).lr_scheduler.warmup_t == 3  # used as given


def test_checkpoint_options_without_checkpoints_are_refused(make_trainer):
    with pytest.raises(ValueError, match="checkpoint_period=0 .* so max_num_checkpoints would"):
        make_trainer(checkpoint_period=0, max_num_checkpoints=2)


@pytest.mark.parametrize(
    "option", ["amp_dtype", "plateau_metric", "checkpoint_by_epoch", "metric_writers",
               "tensorboard", "metrics_jsonl", "compile", "progress_bar"],
)  # fmt: skip
def test_options_of_one_hook_or_of_torch_are_not_trainer_arguments(tmp_path, option):
    """Issue 31: what configures one default hook is that hook's argument (replace the hook),
    torch.compile is the user's call, and enable_amp takes the AMP dtype."""
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{option}'"):
        Trainer(model, optimizer, None, tiny_loader(), max_epochs=1, **{option: None})


def test_an_optimizer_over_another_models_parameters_is_refused(tmp_path):
    model, other = TinyModel(), TinyModel()
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    expected = r"optimizer holds 2 parameters that are not the model's \(shapes \(1, 4\), \(1,\)\)"
    with pytest.raises(ValueError, match=expected + r".*torch\.optim\.SGD\(model\.parameters"):
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
    assert (
        "2 trainable parameters of the model are in no optimizer and will not change: "
        "extra.weight, extra.bias" in caplog.text
    )
    caplog.clear()
    model.extra.requires_grad_(False)  # frozen on purpose: nothing to say
    Trainer(model, optimizer, None, tiny_loader(), max_epochs=2, work_dir=tmp_path).train()
    assert "in no optimizer" not in caplog.text
