"""A torch.compile-d model: checkpoints hold plain weight names, in both directions."""

import os

import pytest
import torch

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
    with pytest.raises(ValueError, match='cuda_graph=True do not combine.*mode="reduce-overhead"'):
        make_trainer(compile=EAGER, cuda_graph=True)
