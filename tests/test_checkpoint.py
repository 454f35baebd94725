"""What checkpoints may hold, and how loading them fails or falls back (trainer/checkpoint.py)."""

import collections
import logging
import os
import re
import threading
import traceback

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainer import HookBase, Trainer
from trainer.checkpoint import read_latest_pointer
from trainer.hooks import BestCheckpointHook, EvalHook

from conftest import RecordLR, TinyModel, build, load, save_checkpoint_file, tiny_loader


class NaNGradientAt(TinyModel):
    """A finite loss whose gradient is NaN at forward call ``at`` (counted from 0)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, batch):
        loss = super().forward(batch)
        self.calls += 1
        if self.calls - 1 == self.at:
            loss = loss + torch.sqrt(self.linear.weight.sum() * 0)  # 0, with a NaN gradient
        return loss


def test_non_finite_weights_are_never_saved_and_the_rerun_resumes_the_last_good_one(make_trainer):
    # the NaN gradient comes at the last iteration of epoch 2, whose loss is finite
    trainer = make_trainer(max_epochs=3, model=NaNGradientAt(15))
    expected = (
        r"Not saving epoch_2\.pth: after iteration 16, "
        r"\['model\.linear\.weight', 'optimizer\.0\.momentum_buffer'\] hold NaN or infinite"
    )
    with pytest.raises(FloatingPointError, match=expected):
        trainer.train()
    assert sorted(os.listdir(trainer.ckpt_dir)) == ["epoch_1.pth", "latest.txt"]
    assert read_latest_pointer(trainer.ckpt_dir) == os.path.join(trainer.ckpt_dir, "epoch_1.pth")

    rerun = make_trainer(max_epochs=3, model=NaNGradientAt(-1))  # the cause fixed
    rerun.train()
    assert rerun.start_iter == 8  # from epoch_1.pth
    weights = load(os.path.join(rerun.ckpt_dir, "epoch_3.pth"))["model"]
    assert all(torch.isfinite(v).all() for v in weights.values())


class Masked(TinyModel):
    """With a buffer that holds -inf on purpose, as a causal attention mask does."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.full((3, 3), float("-inf")).triu(1))


def test_a_buffer_that_holds_infinities_on_purpose_saves_resumes_and_loads(make_trainer, tmp_path):
    """Only the parameters and the optimizer state must be finite: every save of such a model
    was refused ('1 tensors hold NaN or infinite values (model.mask)')."""
    make_trainer(model=Masked(), max_epochs=1).train()
    resumed = make_trainer(model=Masked(), max_epochs=2)
    resumed.train()
    assert resumed.start_iter == 8
    path = os.path.join(resumed.ckpt_dir, "epoch_2.pth")
    fresh = build(tmp_path / "fresh", model=Masked(), max_epochs=1)
    assert fresh.load_checkpoint(path, resume=False)
    weights = load(path)["model"]
    weights["linear.weight"][0, 0] = float("nan")
    torch.save(weights, tmp_path / "nan.pth")
    # saved from a compiled model: the prefix is dropped before the check, not after
    torch.save({f"_orig_mod.{k}": v for k, v in weights.items()}, tmp_path / "compiled.pth")
    with pytest.raises(RuntimeError, match=r"compiled\.pth' holds NaN or infinite values"):
        fresh.load_checkpoint(str(tmp_path / "compiled.pth"), resume=False)
    with pytest.raises(RuntimeError, match=r"nan\.pth' holds NaN .* \['model\.linear\.weight'\]"):
        fresh.load_checkpoint(str(tmp_path / "nan.pth"), resume=False)


class NaNStatistics(Masked):
    """Its running statistic turns NaN after 4 iterations (a buffer, unlike the mask, that no
    run should go on from)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(2))
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        if self.calls > 4:
            self.running.fill_(float("nan"))
        return super().forward(batch)


def test_a_buffer_that_turns_nan_is_never_saved(make_trainer):
    trainer = make_trainer(model=NaNStatistics(), max_epochs=1)
    with pytest.raises(FloatingPointError, match=r"\['model\.running'\] hold NaN"):
        trainer.train()


class Tied(TinyModel):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 1)
        self.head.weight = self.linear.weight  # one parameter, two names in state_dict()


def test_a_nan_under_a_tied_weights_second_name_is_refused(make_trainer, tmp_path):
    weights = Tied().state_dict()
    weights["head.weight"] = torch.full_like(weights["head.weight"], float("nan"))
    torch.save(weights, tmp_path / "tied.pth")
    trainer = make_trainer(model=Tied(), max_epochs=1)
    with pytest.raises(RuntimeError, match=r"holds NaN .* \['model\.head\.weight'\]"):
        trainer.load_checkpoint(str(tmp_path / "tied.pth"), resume=False)


def test_a_non_finite_gradient_norm_fails_like_a_non_finite_loss(make_trainer):
    trainer = make_trainer(max_epochs=2, model=NaNGradientAt(5), clip_grad_norm=1.0)
    # the 6th iteration (cur_iter 5), named by its number
    expected = r"The gradient norm \(the loss was not\) became NaN or infinite at iteration 6 "
    with pytest.raises(FloatingPointError, match=expected):
        trainer.train()
    assert not os.path.exists(trainer.ckpt_dir) or os.listdir(trainer.ckpt_dir) == []


def test_auto_resume_skips_a_checkpoint_with_non_finite_weights(make_trainer, caplog, tmp_path):
    trainer = make_trainer(max_epochs=2)
    trainer.train()
    newest = os.path.join(trainer.ckpt_dir, "epoch_2.pth")
    data = load(newest)
    data["model"]["linear.bias"][0] = float("nan")
    save_checkpoint_file(data, newest)  # as a run from before saves refused NaN could leave it
    save_checkpoint_file(data, tmp_path / "bad.pth")
    rerun = make_trainer(max_epochs=2)
    rerun.train()
    assert rerun.start_iter == 8  # from epoch_1.pth
    assert "epoch_2.pth' holds NaN or infinite values in ['model.linear.bias']" in caplog.text
    with pytest.raises(RuntimeError, match="holds NaN or infinite values"):
        make_trainer(max_epochs=2).load_checkpoint(str(tmp_path / "bad.pth"))


def test_resuming_with_another_optimizer_class_names_the_checkpoint_and_both_classes(tmp_path):
    first = build(tmp_path, max_epochs=1)  # SGD
    first.train()
    model = TinyModel()
    adam = Trainer(
        model,
        torch.optim.Adam(model.parameters()),
        None,
        tiny_loader(),
        max_epochs=2,
        work_dir=tmp_path,
    )
    with pytest.raises(ValueError, match=r"epoch_1\.pth' holds SGD state for optimizer, not Adam"):
        adam.train()


def damage(ckpt_dir, how):
    """Damage the newest of two epoch checkpoints (epoch_2.pth) or the pointer, as ``how`` says."""
    newest = ckpt_dir / "epoch_2.pth"
    if how == "wrong types":
        save_checkpoint_file({key: 5 for key in load(newest)}, newest)
    elif how == "a weight that is not a tensor":
        data = load(newest)
        data["model"]["linear.weight"] = 5
        save_checkpoint_file(data, newest)
    elif how == "progress without epoch":
        data = load(newest)
        del data["progress"]["epoch"]
        save_checkpoint_file(data, newest)
    elif how == "non-UTF-8 pointer":
        (ckpt_dir / "latest.txt").write_bytes(b"\xff\xfe\x00epoch")
    elif how == "pointer is a directory":
        (ckpt_dir / "latest.txt").unlink()
        (ckpt_dir / "latest.txt").mkdir()
    elif how == "dangling symlink":
        (ckpt_dir / "epoch_9.pth").symlink_to(ckpt_dir / "gone.pth")
        (ckpt_dir / "latest.txt").write_text("epoch_9.pth")
    elif how == "directory named .pth":
        (ckpt_dir / "epoch_9.pth").mkdir()
        (ckpt_dir / "latest.txt").write_text("epoch_9.pth")


@pytest.mark.parametrize(
    "how, start_iter, warning",
    [
        ("wrong types", 8, "epoch_2.pth' is damaged: 'progress' is of type int, not dict"),
        ("a weight that is not a tensor", 8, "'model' holds 1 entries that are not tensors"),
        ("progress without epoch", 8, "epoch_2.pth' is damaged: 'progress' lacks 'epoch'"),
        ("non-UTF-8 pointer", 16, "latest.txt is damaged ('utf-8' codec can't decode"),
        ("pointer is a directory", 16, "latest.txt is damaged ([Errno 21] Is a directory"),
        ("dangling symlink", 16, "No such file or directory: "),
        ("directory named .pth", 16, "epoch_9.pth' is a directory, not a checkpoint"),
    ],
)
def test_a_damaged_newest_checkpoint_or_pointer_falls_back_with_a_warning(
    make_trainer, tmp_path, caplog, how, start_iter, warning
):
    make_trainer(max_epochs=2).train()
    damage(tmp_path / "work" / "checkpoints", how)
    rerun = make_trainer(max_epochs=3)
    rerun.train()  # falls back; and the next save replaces a damaged pointer
    assert rerun.start_iter == start_iter
    assert caplog.text.count(warning) == 1  # the folder is listed once per resume
    assert read_latest_pointer(rerun.ckpt_dir) == os.path.join(rerun.ckpt_dir, "epoch_3.pth")


def multistep(optimizer):
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[3, 4], gamma=0.1)


def sequential(optimizer):
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=1)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, multistep(optimizer)], [1])


def chained(optimizer):
    decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    return torch.optim.lr_scheduler.ChainedScheduler([decay, multistep(optimizer)])


@pytest.mark.parametrize("scheduler", [multistep, sequential, chained])
def test_multistep_lr_resumes_exactly_alone_and_inside_other_schedulers(tmp_path, scheduler):
    # MultiStepLR keeps its milestones in a Counter: copied wrongly, it never decays after a resume
    whole = build(tmp_path / "whole", scheduler=scheduler, max_epochs=5)
    lrs = RecordLR()
    whole.register_hook(lrs)
    whole.train()
    build(tmp_path / "cut", scheduler=scheduler, max_epochs=2).train()
    resumed = build(tmp_path / "cut", scheduler=scheduler, max_epochs=5)
    resumed_lrs = RecordLR()
    resumed.register_hook(resumed_lrs)
    resumed.train()
    assert resumed.start_iter == 16
    assert resumed_lrs.lrs == lrs.lrs[16:]
    assert len(set(resumed_lrs.lrs)) >= 2  # it decays after the resume
    final = "epoch_5.pth"
    for key in ("model", "optimizer", "lr_scheduler"):
        assert_equal_state(
            load(tmp_path / "whole/checkpoints" / final)[key],
            load(tmp_path / "cut/checkpoints" / final)[key],
        )


def assert_equal_state(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and a.keys() == b.keys()
        for key in a:
            assert_equal_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_state(x, y)
    else:
        assert a == b and type(a) is type(b)


class StateHook(HookBase):
    """A hook whose state_dict() returns ``state``."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return {"counts": self.state}

    def load_state_dict(self, state):
        self.loaded = state["counts"]


class Opaque:
    pass


class Tagged(torch.Tensor):
    """A tensor subclass: saved as such, its type would not load with weights_only=True."""


@pytest.mark.parametrize(
    "state, what",
    [
        (collections.defaultdict(int, {"a": 1}), "a collections.defaultdict"),
        (collections.namedtuple("Pair", "a b")(1, 2), "a test_checkpoint.Pair"),
        ({"nested": [1, Opaque()]}, "a test_checkpoint.Opaque"),
        (np.float32(0.5), "a numpy.float32"),
        (np.arange(3), "a numpy.ndarray"),
        (torch.zeros(2).as_subclass(Tagged), "a test_checkpoint.Tagged"),
    ],
)
def test_state_that_would_not_load_is_refused_when_saved_naming_its_owner(
    make_trainer, state, what
):
    trainer = make_trainer(max_epochs=2)
    trainer.register_hook(StateHook(state))
    where = "state_dict()['counts']" + (
        "['nested'][1]" if isinstance(state, dict) and "nested" in state else ""
    )
    expected = (
        f"Not saving epoch_1.pth: the state_dict() of hook 'StateHook' holds {what} at {where}, "
        "which torch.load(weights_only=True) cannot rebuild"
    )
    with pytest.raises(TypeError, match=re.escape(expected)):
        trainer.train()
    assert not os.path.exists(os.path.join(trainer.ckpt_dir, "epoch_1.pth"))


def test_a_registered_object_with_unloadable_state_is_refused_naming_it(make_trainer):
    trainer = make_trainer(max_epochs=1)

    class Holder:
        def state_dict(self):
            return {"when": Opaque()}

        def load_state_dict(self, state):
            pass

    trainer.checkpointer.register("holder", Holder())
    with pytest.raises(
        TypeError, match=r"'holder' holds a test_checkpoint\.Opaque at .*\['when'\]"
    ):
        trainer.train()


class Carried:
    """A plain object with state, not a module, optimizer or scheduler: what a step carries from
    one iteration to the next, its state_dict() the value itself."""

    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, state):
        self.value = state


@pytest.mark.parametrize("value", [None, (torch.arange(3.0), torch.ones(2)), [1, "a"], 2.5])
def test_a_registered_plain_object_resumes_whatever_plain_data_its_state_is(make_trainer, value):
    first = make_trainer(max_epochs=1)
    first.checkpointer.register("carried", Carried(value))
    first.train()
    saved = load(os.path.join(first.ckpt_dir, "epoch_1.pth"))["carried"]  # weights_only=True
    rerun = make_trainer(max_epochs=2)
    carried = Carried("not resumed")
    rerun.checkpointer.register("carried", carried)
    rerun.train()
    assert rerun.start_iter == 8  # resumed, not refused as damaged
    for loaded in (saved, carried.value):
        assert type(loaded) is type(value)
        if isinstance(value, tuple):
            assert all(torch.equal(a, b) for a, b in zip(loaded, value))
        else:
            assert loaded == value


class NumpyDecay:
    """An LR lambda holding NumPy numbers, which LambdaLR saves as the callable's attributes."""

    def __init__(self):
        self.base, self.steps = np.float64(0.5), np.int64(3)

    def __call__(self, epoch):
        return float(self.base ** min(epoch, self.steps))


def test_numpy_numbers_and_counters_round_trip_as_what_they_equal(tmp_path):
    state = {
        "counter": collections.Counter({3: 2, 5: 1}),
        "order": collections.OrderedDict(b=1),
        "np": [np.float64(0.1), np.int64(7), np.bool_(True)],
        "set": {1, 2},
    }
    trainer = build(tmp_path / "work", max_epochs=1, scheduler=lambda o: LambdaLR(o, NumpyDecay()))
    hook = StateHook(state)
    trainer.register_hook(hook)
    trainer.train()
    saved = load(tmp_path / "work/checkpoints/epoch_1.pth")
    assert_equal_state(
        saved["hooks"]["StateHook"]["counts"],
        {
            "counter": collections.Counter({3: 2, 5: 1}),
            "order": collections.OrderedDict(b=1),
            "np": [0.1, 7, True],
            "set": {1, 2},
        },
    )
    lambdas = saved["lr_scheduler"]["torch_scheduler"]["lr_lambdas"]
    assert lambdas == [{"base": 0.5, "steps": 3}]


def test_a_lambda_lr_holding_numpy_numbers_resumes_exactly(tmp_path):
    def scheduler(optimizer):
        return LambdaLR(optimizer, NumpyDecay())

    whole = build(tmp_path / "whole", scheduler=scheduler, max_epochs=4)
    whole.train()
    build(tmp_path / "cut", scheduler=scheduler, max_epochs=2).train()
    resumed = build(tmp_path / "cut", scheduler=scheduler, max_epochs=4)
    resumed.train()
    assert resumed.start_iter == 16
    assert_equal_state(
        load(tmp_path / "whole/checkpoints/epoch_4.pth")["model"],
        load(tmp_path / "cut/checkpoints/epoch_4.pth")["model"],
    )


@pytest.mark.parametrize(
    "progress, problem",
    [
        ({"epoch": -3}, "'progress' has 'epoch' = -3, expected an int >= 0"),
        ({"inner_iter": 9}, "'progress' has 'inner_iter' = 9, expected an int from 0 to 8"),
        ({"inner_iter": -1}, "'progress' has 'inner_iter' = -1, expected an int from 0 to 8"),
        ({"iters_done": -5}, "'progress' has 'iters_done' = -5, expected an int >= 0"),
        ({"epoch_len": 0}, "'progress' has 'epoch_len' = 0, expected an int >= 1 or None"),
        ({"epoch": 1.0}, "'progress' has 'epoch' = 1.0, expected an int >= 0"),
    ],
)
def test_progress_out_of_range_is_refused_as_damage(
    make_trainer, tmp_path, caplog, progress, problem
):
    make_trainer(max_epochs=2).train()
    newest = tmp_path / "work/checkpoints/epoch_2.pth"
    data = load(newest)
    data["progress"].update(progress)
    save_checkpoint_file(data, newest)
    save_checkpoint_file(data, tmp_path / "bad.pth")
    rerun = make_trainer(max_epochs=3)
    rerun.train()
    assert rerun.start_iter == 8  # epoch_1.pth, the newest that loads
    assert f"epoch_2.pth' is damaged: {problem}" in caplog.text
    with pytest.raises(RuntimeError, match=re.escape(problem)):
        make_trainer(max_epochs=3).load_checkpoint(str(tmp_path / "bad.pth"))


# ---- pretrained weights -------------------------------------------------------------------


def pretrained(tmp_path):
    """A TinyModel's weights, other than a fresh one's, and a fresh trainer to load them."""
    torch.manual_seed(1)
    weights = TinyModel().state_dict()
    return weights, build(tmp_path / "work", max_epochs=1)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda w: w,
        lambda w: {"state_dict": w, "meta": {}},  # MMEngine's, timm's
        lambda w: {"model_state_dict": w, "epoch": 3},  # PyTorch's tutorials'
        lambda w: {"model": w},  # the trainer's own
    ],
)
def test_pretrained_weights_load_from_a_state_dict_or_a_dict_holding_one(tmp_path, wrap):
    weights, trainer = pretrained(tmp_path)
    torch.save(wrap(weights), tmp_path / "weights.pth")
    assert trainer.load_checkpoint(str(tmp_path / "weights.pth"), resume=False)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert trainer.start_iter == 0  # weights alone: the training state is the trainer's own


def test_revise_keys_renames_a_ddp_checkpoints_keys_before_loading(tmp_path):
    weights, trainer = pretrained(tmp_path)
    torch.save({f"module.{k}": v for k, v in weights.items()}, tmp_path / "ddp.pth")
    path = str(tmp_path / "ddp.pth")
    rename = "revise_keys=[('^module\\\\.', '')]) renames them."
    with pytest.raises(RuntimeError, match="does not match the model") as e:
        trainer.load_checkpoint(path, resume=False)
    assert str(e.value).endswith(rename)
    # not one key matches: an error naming both sides and the renaming (it was a success that
    # had loaded nothing)
    with pytest.raises(RuntimeError) as e:
        trainer.load_checkpoint(path, resume=False, strict=False)
    message = str(e.value)
    assert message.startswith(f"Checkpoint {path!r} holds none of the model's weights")
    assert "['module.linear.weight', 'module.linear.bias'] (2 in all)" in message
    assert "['linear.weight', 'linear.bias'] (2 in all)" in message
    assert message.endswith(rename)
    assert trainer.load_checkpoint(path, resume=False, revise_keys=[(r"^module\.", "")])
    assert torch.equal(trainer.model.linear.weight, weights["linear.weight"])


def test_strict_false_loads_what_matches_in_name_and_shape_and_says_what_it_skipped(
    tmp_path, caplog
):
    weights, trainer = pretrained(tmp_path)
    weights["linear.bias"] = 3  # not a tensor: neither loaded nor a crash
    weights["head.weight"] = torch.zeros(2)
    torch.save(weights, tmp_path / "other.pth")
    bias = trainer.model.linear.bias.clone()
    trainer.load_checkpoint(str(tmp_path / "other.pth"), resume=False, strict=False)
    assert torch.equal(trainer.model.linear.weight, weights["linear.weight"])
    assert torch.equal(trainer.model.linear.bias, bias)
    assert "loaded 1 of the model's 2 entries and skipped:" in caplog.text
    assert "not in the model: head.weight" in caplog.text
    assert "shapes differ: linear.bias int vs (1,)" in caplog.text


@pytest.mark.parametrize(
    "revise_keys, resume, error, message",
    [
        ([(r"^module\.", "")], True, ValueError, "revise_keys renames the weights of a load with"),
        ("^module", False, TypeError, "revise_keys must be a list of (regex, replacement)"),
        ([("^module",)], False, TypeError, "revise_keys must be a list of (regex, replacement)"),
        ([(r"\.(weight|bias)$", "")], False, ValueError, "renames two keys of"),
    ],
)
def test_revise_keys_is_checked(tmp_path, revise_keys, resume, error, message):
    weights, trainer = pretrained(tmp_path)
    torch.save(weights, tmp_path / "weights.pth")
    with pytest.raises(error, match=re.escape(message)):
        trainer.load_checkpoint(
            str(tmp_path / "weights.pth"), resume=resume, revise_keys=revise_keys
        )


def test_a_file_without_weights_is_refused_and_pickled_code_never_runs(tmp_path):
    _, trainer = pretrained(tmp_path)
    torch.save({"epoch": 3, "note": "no weights"}, tmp_path / "meta.pth")
    with pytest.raises(RuntimeError, match=r"(?s)meta\.pth' does not match.*model: epoch"):
        trainer.load_checkpoint(str(tmp_path / "meta.pth"), resume=False)
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"linear.weight": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(RuntimeError, match="could not be loaded safely"):
        trainer.load_checkpoint(str(tmp_path / "evil.pth"), resume=False)
    assert not marker.exists()


@pytest.mark.parametrize("resume", [True, False])
def test_load_checkpoint_of_a_file_of_zeros_is_refused_without_torchs_advice(tmp_path, resume):
    """As a 2 GiB file of zeros would: torch takes it for its old tar format and advises
    weights_only=False, which the error must not pass on."""
    _, trainer = pretrained(tmp_path)
    path = tmp_path / "model.pth"
    with open(path, "wb") as f:
        f.truncate(4 << 20)  # 4 MiB of zeros
    with pytest.raises(RuntimeError) as error:
        trainer.load_checkpoint(str(path), resume=resume)
    expected = f"Checkpoint {str(path)!r} is damaged or no torch.save file"
    assert str(error.value).startswith(expected)
    shown = "".join(traceback.format_exception(error.value))  # what the user sees, causes too
    assert "weights_only=False" not in shown and "set to `False`" not in shown


def test_a_loader_state_that_would_not_load_is_refused_before_saving(make_trainer):
    class StatefulLoader(list):  # a data loader with a state of its own, here not plain data
        def state_dict(self):
            return {"pos": np.arange(3)}

        def load_state_dict(self, state):
            pass

    trainer = make_trainer(loader=StatefulLoader(tiny_loader()), max_iters=3, checkpoint_period=0)
    trainer.train()
    trainer.progress.position = (0, 2)  # in mid-pass, where the loader's state is saved
    with pytest.raises(TypeError, match=r"state_dict\(\) of the data loader holds a numpy"):
        trainer.save_checkpoint("mid.pth")
    assert not os.path.exists(os.path.join(trainer.ckpt_dir, "mid.pth"))


def test_last_path_names_a_checkpoint_once_its_write_is_complete(tmp_path, monkeypatch):
    trainer = build(tmp_path, max_epochs=1)
    trainer.train()
    checkpointer, first = trainer.checkpointer, str(tmp_path / "checkpoints" / "epoch_1.pth")
    go_on, real_save = threading.Event(), torch.save

    def held_save(obj, f, *args, **kwargs):  # the write waits for the test
        go_on.wait()
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", held_save)
    path = trainer.save_checkpoint("extra.pth")
    assert checkpointer.last_path == first  # not extra.pth, still being written
    assert checkpointer.newest_on_disk() == (first, 8)
    go_on.set()
    checkpointer.wait()
    assert checkpointer.last_path == path and os.path.isfile(path)
    assert checkpointer.newest_on_disk() == (path, 8)


def test_a_work_dir_named_with_glob_characters_resumes_its_own_checkpoints(tmp_path):
    other = build(tmp_path / "exp1", max_epochs=1)  # what "exp[1]" matches as a pattern
    other.train()
    stray = tmp_path / "exp1" / "checkpoints" / ".iter_3.pth.abc.tmp"  # another run's write
    stray.write_bytes(b"in progress")
    build(tmp_path / "exp[1]", max_epochs=2).train()
    rerun = build(tmp_path / "exp[1]", max_epochs=3)
    rerun.train()
    assert rerun.start_iter == 16  # its own epoch_2.pth, not exp1's epoch_1.pth or a fresh start
    assert stray.read_bytes() == b"in progress"  # nothing touched outside its work_dir


@pytest.mark.parametrize("name", ["/abs/x.pth", "../x.pth", "sub/../../x.pth", "", ".", 7])
def test_a_checkpoint_name_leading_out_of_the_checkpoint_folder_is_refused(
    make_trainer, tmp_path, name
):
    trainer = make_trainer(max_epochs=1)
    error = TypeError if isinstance(name, int) else ValueError
    with pytest.raises(error, match="file_name must (be|name) a file"):
        trainer.save_checkpoint(name)
    with pytest.raises(error, match="file_name must (be|name) a file"):
        BestCheckpointHook("acc", file_name=name)
    assert not os.path.exists(trainer.ckpt_dir) or os.listdir(trainer.ckpt_dir) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    os.makedirs(os.path.join(trainer.ckpt_dir, "sub"))
    trainer.save_checkpoint("sub/x.pth")  # a sub-folder is inside
    trainer.checkpointer.wait()
    assert os.path.isfile(os.path.join(trainer.ckpt_dir, "sub", "x.pth"))


def test_raising_max_iters_past_a_pass_that_max_iters_cut_says_what_is_skipped(tmp_path, caplog):
    build(tmp_path, max_iters=5).train()  # passes of 8 iterations: the first ended after 5
    rerun = build(tmp_path, max_iters=12)
    rerun.train()
    assert rerun.start_iter == 8
    assert (
        "ends a run whose max_iters ended its last pass after 5 iterations, 3 before the pass's "
        "end: this run goes on with the next pass, at iteration 9, without those 3."
    ) in caplog.text
    caplog.clear()
    build(tmp_path / "whole", max_epochs=1).train()  # a whole pass: nothing to say
    build(tmp_path / "whole", max_epochs=2).train()
    assert "ends a run whose max_iters" not in caplog.text


def blocked_write(monkeypatch, name: str) -> threading.Event:
    """From now on, the write of checkpoint ``name`` waits until the returned event is set."""
    release = threading.Event()
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if os.path.basename(getattr(f, "name", "")) == f".{name}.tmp":  # its temporary file
            assert release.wait(timeout=120), "never released"
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return release


class ReleaseOn(logging.Handler):
    """Sets ``event`` when a record starting with ``prefix`` is logged."""

    def __init__(self, prefix, event):
        super().__init__()
        self.prefix, self.event = prefix, event

    def emit(self, record):
        if record.getMessage().startswith(self.prefix):
            self.event.set()


@pytest.mark.parametrize("sharded", [False, True])
def test_a_save_says_when_it_starts_and_when_it_is_on_disk(make_trainer, caplog, sharded):
    trainer = make_trainer(max_epochs=1)
    trainer.checkpointer.sharded = sharded
    trainer.save_checkpoint("manual.pth")
    trainer.checkpointer.wait()
    path = os.path.join(trainer.ckpt_dir, "manual.pth")
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("trainer")]
    assert ours == [  # (torch's DCP logs records of its own)
        f"Writing checkpoint {path} (after iteration 0) in the background.",
        f"Saved checkpoint {path} (on disk).",
    ]
    assert trainer.checkpointer.last_path == path


def test_a_failure_during_a_write_names_that_checkpoint_once_it_is_on_disk(
    make_trainer, caplog, monkeypatch
):
    release = blocked_write(monkeypatch, "epoch_2.pth")

    class Fail(HookBase):
        def before_epoch(self):
            if self.trainer.cur_epoch == 2:  # epoch_2.pth is being written
                release.set()
                raise ValueError("injected failure")

    trainer = make_trainer(max_epochs=3)
    trainer.register_hook(Fail())
    with pytest.raises(ValueError, match="injected failure"):
        trainer.train()
    ckpt = trainer.ckpt_dir
    line = (
        f"Training failed in iteration 16 of 24 (last checkpoint on disk: {ckpt}/epoch_2.pth): "
        "ValueError: injected failure"
    )
    messages = caplog.messages
    # train() waited for the write in flight before the hooks' after_train, which logs the line
    assert messages.index(f"Saved checkpoint {ckpt}/epoch_2.pth (on disk).") < messages.index(line)
    assert trainer.checkpointer.last_path == f"{ckpt}/epoch_2.pth"


def test_a_failure_before_any_save_says_there_is_none(make_trainer, caplog):
    class Fail(HookBase):
        def after_iter(self):
            raise ValueError("injected failure")

    trainer = make_trainer(max_epochs=1)
    trainer.register_hook(Fail())
    with pytest.raises(ValueError):
        trainer.train()
    assert (
        "Training failed in iteration 1 of 8 (last checkpoint on disk: none): ValueError: "
        "injected failure"
    ) in caplog.messages


def test_one_registry_holds_the_trainers_parts_and_the_users_by_name(make_trainer):
    """A registered thing sits beside the trainer's own at the checkpoint's top level; a name
    the checkpoint uses already is refused."""
    trainer = make_trainer(max_epochs=1)
    second = torch.optim.SGD(trainer.model.parameters(), lr=0.5)
    trainer.checkpointer.register("second", second)
    for taken in ("model", "optimizer", "rng", "lr_scheduler", "hooks", "second"):
        with pytest.raises(ValueError, match=f"'{taken}' is registered already"):
            trainer.checkpointer.register(taken, torch.optim.SGD(trainer.model.parameters(), 1))
    trainer.train()
    saved = load(os.path.join(trainer.ckpt_dir, "epoch_1.pth"))
    assert saved["second"] == second.state_dict()
    assert saved["config"]["classes"]["second"] == "SGD"
    assert {"CheckpointHook", "LoggerHook"} <= set(saved["hooks"])  # the hooks, as one thing


# ---- a fresh start ----------------------------------------------------------------------------


def moved_to(caplog):
    """The folder that the fresh start's line names."""
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Starting")]
    return re.search(r" to (\S+)\.$", line)[1]


def test_a_fresh_start_sets_the_earlier_run_aside_and_never_falls_back_to_it(tmp_path, caplog):
    build(tmp_path, max_epochs=3, lr=0.1).train()
    ckpt_dir = tmp_path / "checkpoints"
    earlier = {name: (ckpt_dir / name).read_bytes() for name in os.listdir(ckpt_dir)}
    build(tmp_path, max_epochs=1, lr=0.01).train(auto_resume=False)  # the new run's first epoch
    folder = moved_to(caplog)
    assert os.path.dirname(folder) == str(ckpt_dir / "previous")
    assert {name: open(os.path.join(folder, name), "rb").read() for name in earlier} == earlier
    assert sorted(os.listdir(ckpt_dir)) == ["epoch_1.pth", "latest.txt", "previous"]
    (ckpt_dir / "epoch_1.pth").write_bytes(b"damaged")
    rerun = build(tmp_path, max_epochs=3, lr=0.01)
    with pytest.raises(RuntimeError, match=r"No checkpoint in .* loads; train\(auto_resume=False"):
        rerun.train()  # not the earlier run's epoch_3.pth (LR 0.1, finished)
    assert sorted(os.listdir(folder)) == sorted(earlier)  # still there, as the line said


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "sharded"])
def test_a_rerun_of_a_fresh_start_resumes_the_new_run(tmp_path, caplog, sharded):
    def trainer(max_epochs, lr):
        made = build(tmp_path, max_epochs=max_epochs, lr=lr)
        made.checkpointer.sharded = sharded
        made.register_hook(BestCheckpointHook("acc", mode="max"))
        made.register_hook(EvalHook(1, lambda: {"acc": 1.0}))
        return made

    trainer(2, lr=0.1).train()
    trainer(1, lr=0.01).train(auto_resume=False)
    folder = moved_to(caplog)
    assert sorted(os.listdir(folder)) == ["best.pth", "epoch_1.pth", "epoch_2.pth", "latest.txt"]
    rerun = trainer(2, lr=0.01)
    rerun.train()
    assert rerun.start_iter == 8  # after the new run's epoch 1 (not the earlier run's 2 epochs)
    assert rerun.optimizer.param_groups[0]["initial_lr"] == 0.01
    names = ["best.pth", "epoch_1.pth", "epoch_2.pth", "latest.txt", "previous"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == names
    caplog.clear()
    trainer(2, lr=0.01).train(auto_resume=False)  # once more: beside the first folder moved
    assert len(os.listdir(tmp_path / "checkpoints" / "previous")) == 2
    assert os.path.dirname(moved_to(caplog)) == os.path.dirname(folder)
