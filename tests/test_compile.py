"""A torch.compile-d model: checkpoints hold plain weight names, in both directions."""

import os

import pytest
import torch

from trainer.hooks import EMAHook

from conftest import TinyModel

EAGER = {"backend": "eager"}  # dynamo without code generation: fast, and CI needs no compiler


def weights(trainer):
    return {k: v.clone() for k, v in trainer.model_or_module.state_dict().items()}


def test_a_compiled_model_trains_as_the_plain_one_and_saves_plain_names(make_trainer, tmp_path):
    compiled = make_trainer(max_epochs=1, compile=EAGER)
    assert type(compiled.model).__name__ == "OptimizedModule"
    compiled.train()
    plain = make_trainer(max_epochs=1, work_dir=tmp_path / "plain")
    plain.train()
    saved = torch.load(os.path.join(compiled.ckpt_dir, "epoch_1.pth"), weights_only=True)
    model = TinyModel()
    model.load_state_dict(saved["model"])  # strict: no "_orig_mod." in the names
    for name, value in weights(plain).items():
        assert torch.equal(saved["model"][name], value), name


def test_checkpoints_move_between_plain_and_compiled_models(make_trainer, tmp_path):
    make_trainer(max_epochs=1).train()
    resumed = make_trainer(max_epochs=2, compile=EAGER)
    resumed.train()  # a compiled model resumes the plain run's checkpoint
    full = make_trainer(max_epochs=2, work_dir=tmp_path / "full")
    full.train()
    for name, value in weights(full).items():
        assert torch.equal(weights(resumed)[name], value), name
    # weights saved from a compiled model's own state_dict() load too
    prefixed = {f"_orig_mod.{k}": v for k, v in weights(full).items()}
    torch.save({"model": prefixed}, tmp_path / "prefixed.pth")
    fresh = make_trainer(max_epochs=1, work_dir=tmp_path / "fresh")
    fresh.load_checkpoint(str(tmp_path / "prefixed.pth"), resume=False)
    for name, value in weights(full).items():
        assert torch.equal(weights(fresh)[name], value), name


def test_a_compiled_model_with_cuda_graph_is_refused_naming_the_fix(make_trainer):
    with pytest.raises(ValueError, match="cuda_graph=True with a compiled model.*reduce-overhead"):
        make_trainer(compile=EAGER, cuda_graph=True)


class Nested(torch.nn.Module):
    """A body in a container and a head: places for torch.compile inside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.head = torch.nn.Linear(4, 1)

    def forward(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.body(x)), y)


def plain(trainer):
    """The trainer's weights under the uncompiled model's names."""
    return {k.replace("_orig_mod.", ""): v for k, v in weights(trainer).items()}


def nested(placement):
    torch.manual_seed(0)
    model = Nested()
    if placement in ("head", "everywhere"):
        model.head = torch.compile(model.head, **EAGER)
    if placement in ("in a container", "everywhere"):
        model.body[0] = torch.compile(model.body[0], **EAGER)
    if placement == "everywhere":
        model = torch.compile(model, **EAGER)
    return model


@pytest.mark.parametrize("placement", ["head", "in a container", "everywhere"])
def test_a_model_compiled_in_parts_resumes_exactly_and_loads_as_plain_weights(
    make_trainer, tmp_path, placement
):
    full = make_trainer(max_epochs=2, model=nested(placement), work_dir=tmp_path / "full")
    full.train()
    make_trainer(max_epochs=1, model=nested(placement)).train()
    resumed = make_trainer(max_epochs=2, model=nested(placement))
    resumed.train()  # resumes the first run's epoch_1 checkpoint
    assert resumed.checkpointer.last_path.endswith("epoch_2.pth")
    expected = plain(full)
    for name, value in plain(resumed).items():
        assert torch.equal(value, expected[name]), name
    saved = torch.load(os.path.join(resumed.ckpt_dir, "epoch_2.pth"), weights_only=True)
    model = Nested()
    model.load_state_dict(saved["model"])  # strict: the uncompiled model's names
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    # and the file loads as weights into the model compiled any other way
    for other in ("plain", "head", "in a container", "everywhere"):
        fresh = make_trainer(model=nested(other), work_dir=tmp_path / other)
        fresh.load_checkpoint(os.path.join(resumed.ckpt_dir, "epoch_2.pth"), resume=False)
        for name, value in plain(fresh).items():
            assert torch.equal(value, expected[name]), (other, name)


def test_a_real_weight_is_kept_when_a_compiled_spelling_of_it_is_in_the_file_too(
    make_trainer, tmp_path
):
    real = {k: torch.full_like(v, 1.0) for k, v in Nested().state_dict().items()}
    other = {
        k.replace("head.", "head._orig_mod."): torch.full_like(v, 2.0)
        for k, v in real.items()
        if k.startswith("head.")
    }
    torch.save({**real, **other}, tmp_path / "both.pth")
    fresh = make_trainer(model=Nested())
    with pytest.raises(RuntimeError, match=r"not in the model: head\._orig_mod\.weight"):
        fresh.load_checkpoint(str(tmp_path / "both.pth"), resume=False)
    fresh.load_checkpoint(str(tmp_path / "both.pth"), resume=False, strict=False)
    for name, value in weights(fresh).items():
        assert torch.equal(value, real[name]), name


def test_an_ema_of_a_model_compiled_in_parts_resumes_into_the_model_compiled_otherwise(
    make_trainer, tmp_path
):
    def with_ema(placement, epochs, work_dir):
        trainer = make_trainer(max_epochs=epochs, model=nested(placement), work_dir=work_dir)
        ema = EMAHook(decay=0.9)
        trainer.register_hook(ema)
        trainer.train()
        return ema.ema_state_dict()  # under the uncompiled model's names

    full = with_ema("head", 2, tmp_path / "full")
    with_ema("head", 1, tmp_path / "work")
    resumed = with_ema("plain", 2, tmp_path / "work")  # its average resumes from epoch_1.pth
    assert resumed.keys() == full.keys() == Nested().state_dict().keys()
    for name, value in resumed.items():
        assert torch.equal(value, full[name]), name
