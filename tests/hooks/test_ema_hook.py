"""EMAHook: the average against a reference computation, resume, evaluation, export."""

import gc
import os
import weakref

import pytest
import torch

from trainer import HookBase
from trainer.hooks import EMAHook


class Snapshots(HookBase):
    """The model's parameters after every step (runs before EMAHook)."""

    def __init__(self):
        self.seen = []

    def after_iter(self):
        self.seen.append({k: p.detach().clone() for k, p in self.trainer.model.named_parameters()})


def test_the_average_matches_a_reference_computation(make_trainer):
    trainer = make_trainer(max_epochs=2)
    start = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    snapshots, ema = Snapshots(), EMAHook(decay=0.9, period=2)
    trainer.register_hooks([snapshots, ema])
    trainer.train()
    expected = dict(start)
    for weights in snapshots.seen[1::2]:  # after iterations 2, 4, ...
        expected = {k: torch.lerp(expected[k], weights[k], 0.1) for k in expected}
    got = ema.ema_state_dict()
    assert got.keys() == trainer.model.state_dict().keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-7)
        assert not torch.equal(got[name], trainer.model.state_dict()[name])


def test_the_average_is_checkpointed_and_resumes_exactly(make_trainer, tmp_path):
    full, full_run = EMAHook(decay=0.8), make_trainer(max_epochs=2, work_dir=tmp_path / "full")
    full_run.register_hook(full)
    full_run.train()
    first = make_trainer(max_epochs=1)
    first.register_hook(EMAHook(decay=0.8))
    first.train()
    saved = torch.load(os.path.join(first.ckpt_dir, "epoch_1.pth"), weights_only=True)
    assert set(saved["hooks"]["EMAHook"]["ema"]) == {"linear.weight", "linear.bias"}
    resumed_ema = EMAHook(decay=0.8)
    resumed = make_trainer(max_epochs=2)
    resumed.register_hook(resumed_ema)
    resumed.train()
    for name, value in full.ema_state_dict().items():
        assert torch.equal(value, resumed_ema.ema_state_dict()[name]), name


def test_swapped_evaluates_with_the_average_and_restores_the_weights(make_trainer):
    trainer = make_trainer(max_epochs=1)
    ema = EMAHook(decay=0.5)
    trainer.register_hook(ema)
    trainer.train()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    inside = ema.evaluate(lambda: {k: v.clone() for k, v in trainer.model.state_dict().items()})
    for name, value in ema.ema_state_dict().items():
        assert torch.equal(inside[name], value)
        assert torch.equal(trainer.model.state_dict()[name], before[name])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\), got 1.0"):
        EMAHook(decay=1.0)
    with pytest.raises(ValueError, match="period must be a positive int, got 0"):
        EMAHook(period=0)
    with pytest.raises(TypeError, match="period must be a positive int, got bool True"):
        EMAHook(period=True)


class TiedModel(torch.nn.Module):
    """An embedding and an output layer sharing one weight, as language models do."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, batch):
        (tokens,) = batch
        return torch.nn.functional.cross_entropy(self.head(self.embed(tokens[:, 0])), tokens[:, 1])


def test_the_average_of_tied_weights_exports_under_every_name(make_trainer):
    data = torch.utils.data.TensorDataset(torch.randint(0, 6, (16, 2)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = make_trainer(model=TiedModel(), loader=loader, max_epochs=1)
    ema = EMAHook(decay=0.5)
    trainer.register_hook(ema)
    trainer.train()
    exported = ema.ema_state_dict()
    assert exported.keys() == {"embed.weight", "head.weight"}
    assert torch.equal(exported["embed.weight"], exported["head.weight"])
    fresh = TiedModel()
    fresh.load_state_dict(exported)
    with ema.swapped():
        assert torch.equal(fresh.embed.weight, trainer.model.embed.weight)


def test_the_average_is_exported_and_evaluated_after_the_trainer_is_gone(make_trainer):
    def train():  # returns what a training function would, the Trainer itself freed
        trainer = make_trainer(max_epochs=1)
        ema = EMAHook(decay=0.5)
        trainer.register_hook(ema)
        trainer.train()
        return trainer.model, ema, weakref.ref(trainer)

    model, ema, trainer = train()
    gc.collect()
    assert trainer() is None
    exported = ema.ema_state_dict()
    assert exported.keys() == model.state_dict().keys()
    with ema.swapped():
        assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    assert ema.evaluate(lambda: model.linear.weight.clone()).equal(exported["linear.weight"])


class Layers(torch.nn.Module):
    """Two layers in a ModuleList, the first of which a script compiles on its own."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)])

    def forward(self, batch):
        x, y = batch
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, y)


def test_the_average_of_a_model_with_a_compiled_layer_loads_into_the_plain_model(make_trainer):
    model = Layers()
    model.layers[0] = torch.compile(model.layers[0], backend="eager")  # no code generation
    trainer = make_trainer(model=model, max_epochs=1)
    ema = EMAHook(decay=0.5)
    trainer.register_hook(ema)
    trainer.train()
    exported = ema.ema_state_dict()
    plain = Layers()
    plain.load_state_dict(exported)  # strict: the names the uncompiled model has
    with ema.swapped():
        assert torch.equal(plain.layers[0].weight, model.layers[0].weight)
        assert torch.equal(plain.layers[1].bias, model.layers[1].bias)
    assert not torch.equal(plain.layers[0].weight, model.layers[0].weight)
