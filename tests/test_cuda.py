"""CUDA paths: float16 with a GradScaler, bfloat16, no host sync on non-log iterations (fused
float16 included), exact resume, and whole-step CUDA graphs.

Skipped on machines without a GPU (CI has none); run them where one is available.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer import HookBase, Trainer

from conftest import replaced_default_hooks, with_hooks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def cuda_trainer(
    tmp_path, model_class=None, optimizer="adamw", scheduler=None, partial_last=False,
    capturable=False, **kwargs,
):  # fmt: skip
    torch.manual_seed(0)
    x = torch.randn(512, 64, device="cuda")
    y = torch.randint(0, 10, (512,), device="cuda")
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 512, 64)]
    if partial_last:
        batches.append((x[:32], y[:32]))
    model = (model_class or MLP)().cuda()
    if optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    else:  # capturable: a CUDA graph can hold its step (both twins of a comparison get it)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-3, fused=True, capturable=capturable
        )
    scheduler = scheduler(optimizer) if scheduler else None
    kwargs.setdefault("max_iters", 40)
    hooks = replaced_default_hooks(kwargs)
    trainer = Trainer(model, optimizer, scheduler, DataLoader(batches, batch_size=None),
                      work_dir=str(tmp_path), **kwargs)  # fmt: skip
    return with_hooks(trainer, hooks)


@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
def test_amp_trains_on_cuda(tmp_path, amp_dtype):
    trainer = cuda_trainer(tmp_path, enable_amp=True, amp_dtype=amp_dtype, log_period=10)
    trainer.train()
    loss = trainer.metric_storage["total_loss"]
    assert loss.count == 40 and loss.latest < loss.global_avg
    assert trainer.grad_scaler.is_enabled() == (amp_dtype == torch.float16)


def test_default_amp_dtype_on_cuda_is_float16(tmp_path):
    assert cuda_trainer(tmp_path, enable_amp=True).run_config["amp_dtype"] == "float16"


@pytest.mark.parametrize("kwargs", [{}, {"enable_amp": True, "amp_dtype": torch.bfloat16},
                                    {"enable_amp": True, "amp_dtype": torch.float16},
                                    {"clip_grad_norm": 1.0}])  # fmt: skip
def test_non_log_iterations_do_not_sync(tmp_path, kwargs):
    trainer = cuda_trainer(tmp_path, log_period=20, checkpoint_period=1000, **kwargs)
    train_forbidding_syncs(trainer, lambda it: (it + 1) % 20 != 0)
    assert trainer.metric_storage["total_loss"].count == 40


def train_forbidding_syncs(trainer, forbidden):
    """Train with every host sync an error in the iterations where ``forbidden(iter)`` holds."""

    class SyncGuard(HookBase):
        priority = 0  # first in every event, so it brackets train_one_iter

        def before_iter(self):
            forbid = forbidden(self.trainer.cur_iter)
            torch.cuda.set_sync_debug_mode("error" if forbid else 0)

        def after_iter(self):
            torch.cuda.set_sync_debug_mode(0)

    trainer.register_hook(SyncGuard())
    try:
        trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_log_checks_cuda_tensors_without_a_sync(tmp_path):
    """trainer.log's checks read a tensor's type, shape and device, never its value."""
    trainer = cuda_trainer(tmp_path)
    weight = trainer.model.net[0].weight  # requires grad
    n = torch.tensor(3, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.log(0, total=weight.sum(), corner=weight[:1, :1], n=n, reduce=True)
        with pytest.raises(ValueError, match="Metric 'row' must be a number or a one-element"):
            trainer.log(0, row=weight[0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    trainer.metric_storage.flush(every_rank=True)
    assert trainer.metric_storage["n"].latest == 3.0
    assert trainer.metric_storage["corner"].latest == weight[0, 0].item()


class DropoutMLP(MLP):
    def __init__(self):
        super().__init__()
        self.net.insert(2, nn.Dropout(0.3))  # draws from the CUDA generator


def test_mid_epoch_resume_on_cuda_is_bit_exact(tmp_path):
    class Crash(HookBase):
        def after_iter(self):
            if self.trainer.cur_iter == 13:
                raise KeyboardInterrupt

    def make(work_dir):
        return cuda_trainer(
            work_dir, DropoutMLP, max_iters=24, checkpoint_period=5, checkpoint_by_epoch=False,
            enable_amp=True,
        )  # fmt: skip

    full = make(tmp_path / "full")
    full.train()
    cut = make(tmp_path / "cut")
    cut.register_hook(Crash())
    with pytest.raises(SystemExit):
        cut.train()
    resumed = make(tmp_path / "cut")
    resumed.train()
    assert resumed.start_iter == 10
    for k, v in full.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


# ---- cuda_graph=True -------------------------------------------------------------------------


def losses_per_iter(trainer):
    """Train with log_period=1 and return every iteration's loss."""
    losses = []

    class Record(HookBase):
        def after_iter(self):
            losses.append(self.trainer.metric_storage["total_loss"].latest)

    trainer.register_hook(Record())
    trainer.train()
    return losses


def cosine(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"clip_grad_norm": 0.5, "warmup_t": 20, "scheduler": cosine, "by_epoch": False},
        {"enable_amp": True, "amp_dtype": torch.float16, "clip_grad_norm": 1.0},
        {"enable_amp": True, "amp_dtype": torch.bfloat16},
        {"accumulation_steps": 2},
        {"optimizer": "sgd"},
    ],
)
def test_cuda_graph_matches_eager_training_over_100_steps(tmp_path, caplog, kwargs):
    common = {"max_iters": 100, "log_period": 1, "capturable": True, **kwargs}
    eager = cuda_trainer(tmp_path / "eager", **common)
    graphed = cuda_trainer(tmp_path / "graph", cuda_graph=True, **common)
    eager_losses, graph_losses = losses_per_iter(eager), losses_per_iter(graphed)
    assert "Captured the training step in a CUDA graph" in caplog.text  # it did capture
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-4, atol=1e-5)
    for k, v in eager.model.state_dict().items():
        torch.testing.assert_close(graphed.model.state_dict()[k], v, rtol=1e-4, atol=1e-5)
    assert eager.lr == graphed.lr  # the schedule ran the same in both


def test_cuda_graph_replays_adjust_the_float16_loss_scale_as_eager_steps_do(tmp_path):
    """The scale's update is in the graph: a replay runs no Python, so an update after it would
    find nothing due and the scale would stay as the capture left it."""
    scales = []
    for name, graphed in (("eager", False), ("graph", True)):
        trainer = cuda_trainer(
            tmp_path / name, enable_amp=True, amp_dtype=torch.float16, capturable=True,
            cuda_graph=graphed, max_iters=40,
        )  # fmt: skip
        trainer.grad_scaler.set_growth_interval(5)  # grows every 5 finite steps
        trainer.train()
        scales.append(trainer.grad_scaler.get_scale())
    assert scales[1] == scales[0] > 65536.0


def test_cuda_graph_runs_other_batch_shapes_eagerly_and_dropout_trains(tmp_path, caplog):
    trainer = cuda_trainer(
        tmp_path, DropoutMLP, max_iters=60, cuda_graph=True, capturable=True, partial_last=True
    )
    trainer.train()
    loss = trainer.metric_storage["total_loss"]
    assert loss.count == 60 and loss.latest < loss.global_avg
    assert "differ from the captured" in caplog.text


def test_cuda_graph_replays_make_no_sync(tmp_path):
    trainer = cuda_trainer(
        tmp_path, cuda_graph=True, capturable=True, log_period=20, enable_amp=True,
        amp_dtype=torch.float16,
    )  # fmt: skip
    # iterations 0-2 run eagerly and 3 captures (a sync); later ones replay
    train_forbidding_syncs(trainer, lambda it: it > 3 and (it + 1) % 20 != 0)
    assert trainer.metric_storage["total_loss"].count == 40


def test_cuda_graph_capture_failure_is_a_clear_error(tmp_path):
    class Syncs(MLP):
        def forward(self, batch):
            loss = super().forward(batch)
            return loss * 2 if loss.item() > 100 else loss  # data-dependent control flow

    trainer = cuda_trainer(tmp_path, Syncs, cuda_graph=True, capturable=True)
    with pytest.raises(RuntimeError, match="cuda_graph=True could not capture the step"):
        trainer.train()
