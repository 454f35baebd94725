"""Trainer.evaluate: the exact mean over a data set, in one process and on two torchrun ranks
(both loader shapes, plain, DDP and FSDP2 models), eval mode, no per-batch host read."""

import json
import logging
import os
import re
import textwrap
from subprocess import PIPE

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
    get_worker_info,
)

from trainer import HookBase
from trainer.hooks import BestCheckpointHook, EvalHook

from conftest import communicate, count_host_reads, cpu_env, popen, torchrun_command


def squared_error(model, batch):
    x, y = batch
    return {"se": ((model.linear(x) - y) ** 2).squeeze(1), "one": torch.ones(len(x))}


def data(n=10):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


@pytest.mark.parametrize("batch_size", [1, 3, 4, 10])
def test_the_mean_counts_every_sample_once_whatever_the_batch_size(make_trainer, batch_size):
    trainer = make_trainer()
    x, y = data().tensors
    exact = ((trainer.model.linear(x) - y) ** 2).double().mean().item()
    results = trainer.evaluate(DataLoader(data(), batch_size=batch_size), squared_error)
    assert results == {"se": pytest.approx(exact, rel=1e-6), "one": 1.0}


def test_eval_mode_and_no_autograd_inside_every_module_back_in_its_mode_after(make_trainer):
    trainer = make_trainer()
    model = trainer.model
    model.dropout.eval()  # a frozen part stays as it was put
    seen = []

    def metric_fn(m, batch):
        seen.append((m.training, m.dropout.training, torch.is_grad_enabled()))
        return squared_error(m, batch)

    trainer.evaluate(DataLoader(data(), batch_size=5), metric_fn)
    assert seen == [(False, False, False)] * 2
    assert model.training and not model.dropout.training

    def fails(m, batch):
        raise RuntimeError("metric_fn failed")

    model.dropout.train()
    with pytest.raises(RuntimeError, match="metric_fn failed"):
        trainer.evaluate(DataLoader(data()), fails)
    assert model.training and model.dropout.training


def test_no_host_read_until_the_end(make_trainer, monkeypatch):
    """One read at the end, of every metric at once, however many batches: the sums stay on the
    device."""
    trainer = make_trainer()
    batches = list(DataLoader(data(), batch_size=1))  # 10 (a DataLoader reads its seed once)
    reads = count_host_reads(monkeypatch)
    trainer.evaluate(batches, squared_error)
    assert reads == ["tolist"]  # "se" and "one" together


def test_values_that_are_not_one_per_sample_of_a_distributed_sampler_are_refused(make_trainer):
    """Its padding is told by position: per-token values would cut it in the wrong place."""
    trainer = make_trainer()
    one = DistributedSampler(data(10), num_replicas=1, rank=0, shuffle=False)
    per_token = lambda model, batch: {"t": batch[0].flatten()}  # noqa: E731
    with pytest.raises(ValueError, match="^metric_fn returned 40 values for the 10 samples"):
        trainer.evaluate(DataLoader(data(10), batch_size=3, sampler=one), per_token)
    with pytest.raises(TypeError, match="not callable"):  # Python's own error
        trainer.evaluate(DataLoader(data(10)), None)


@pytest.mark.parametrize(
    "returned, error, message",
    [
        (lambda x: (x.sum(1) > 0).float().mean(), TypeError, "got <class 'torch.Tensor'>"),
        (lambda x: {}, TypeError, "metric_fn must return {name: tensor of shape [batch]}"),
        (lambda x: {"acc": x.sum(1).mean()}, ValueError, "'acc' not as a tensor of shape [batch]"),
        (lambda x: {"acc": 0.5}, ValueError, "'acc' not as a tensor of shape [batch]"),
        (lambda x: {"a": x[:, 0], "b": x[:-1, 0]}, ValueError, "returned [1, 2] values for one"),
        (lambda x: {f"n{len(x)}": x[:, 0]}, ValueError, "returned ['n2'], then ['n1']"),
    ],
)
def test_what_metric_fn_returns_is_checked(make_trainer, returned, error, message):
    trainer = make_trainer()
    with pytest.raises(error, match=re.escape(message)):
        trainer.evaluate(DataLoader(data(3), batch_size=2), lambda m, b: returned(b[0]))


@pytest.mark.parametrize(
    "batches, x",
    [
        ([torch.arange(6.0), torch.arange(6.0, 10.0)], lambda batch: batch),
        (
            [(torch.arange(6.0), torch.ones(6)), (torch.arange(6.0, 10.0), torch.ones(4))],
            lambda batch: batch[0],
        ),
        ([{"x": torch.arange(6.0)}, {"x": torch.arange(6.0, 10.0)}], lambda batch: batch["x"]),
    ],
)
def test_a_batch_mean_of_shape_1_is_refused_not_taken_for_a_sample(make_trainer, batches, x):
    """It weighed each batch as one sample: 5.0 for these batches, whose mean is 4.5 (a batch
    of one sample returns shape [1] rightly: see the test of every batch size above)."""
    trainer = make_trainer()
    mean = lambda model, batch: {"x": x(batch).mean(0, keepdim=True)}  # noqa: E731
    with pytest.raises(
        ValueError, match=r"^metric_fn returned 'x' of shape \[1\] for a batch of 6 s"
    ):
        trainer.evaluate(batches, mean)


def test_a_value_of_shape_1_is_taken_where_the_batch_does_not_tell_its_size(make_trainer):
    """A sequence-first batch (x of [time, batch], y of [batch]) of one sample: its tensors'
    first dimensions disagree, so a value of shape [1] is its sample's, not refused."""
    trainer = make_trainer()
    batches = [(torch.full((7, 1), float(i)), torch.ones(1)) for i in range(3)]
    per_sample = lambda model, batch: {"x": batch[0].mean(0)}  # noqa: E731
    assert trainer.evaluate(batches, per_sample) == {"x": 1.0}


@pytest.mark.parametrize(
    "returned, got",
    [
        (lambda x: (x.sum(1) > 0).float(), "torch.Tensor"),  # a bare per-sample tensor
        (lambda x: [x[:, 0]], "list"),
        (lambda x: None, "NoneType"),
        (lambda x: 0.5, "float"),
    ],
)
def test_metric_fn_must_return_a_dict_of_names_to_per_sample_tensors(make_trainer, returned, got):
    trainer = make_trainer()
    with pytest.raises(TypeError, match=rf"^metric_fn must return \{{name: .*'{got}'"):
        trainer.evaluate(DataLoader(data(3), batch_size=2), lambda m, b: returned(b[0]))


def test_loaders_that_would_leave_samples_out_are_refused(make_trainer):
    trainer = make_trainer()
    with pytest.raises(ValueError, match="^data_loader drops the last 2 samples"):
        trainer.evaluate(DataLoader(data(10), batch_size=4, drop_last=True), squared_error)
    sampler = DistributedSampler(data(10), num_replicas=3, rank=0)
    with pytest.raises(ValueError, match="DistributedSampler is for rank 0 of 3"):
        trainer.evaluate(DataLoader(data(10), sampler=sampler), squared_error)
    batches = BatchSampler(SequentialSampler(data(10)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="^data_loader drops the last 2 samples"):
        trainer.evaluate(DataLoader(data(10), batch_sampler=batches), squared_error)
    with pytest.raises(ValueError, match="yielded no samples"):
        trainer.evaluate([], squared_error)
    one = DistributedSampler(data(10), num_replicas=1, rank=0, shuffle=False)
    with pytest.raises(ValueError, match="^data_loader drops the last 2 samples"):
        trainer.evaluate(DataLoader(data(10), 4, sampler=one, drop_last=True), squared_error)
    for sampler in (
        WeightedRandomSampler([1.0] * 10, num_samples=30),
        RandomSampler(data(10), replacement=True),
        RandomSampler(data(10), num_samples=5),
    ):
        with pytest.raises(ValueError, match="does not draw each sample once"):
            trainer.evaluate(DataLoader(data(10), sampler=sampler), squared_error)
    assert trainer.evaluate(DataLoader(data(10), shuffle=True), squared_error)["one"] == 1.0
    # a DistributedSampler of this one process is fine: the whole set, in its order
    one = DistributedSampler(data(10), num_replicas=1, rank=0)
    assert trainer.evaluate(DataLoader(data(10), sampler=one), squared_error)["one"] == 1.0


class Stream(IterableDataset):
    """data()'s samples ``(x, y, index)`` as a stream; with workers, each yields every
    num_workers-th sample, as PyTorch documents."""

    def __init__(self, n=10):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        x, y = data(self.n).tensors
        for i in range(first, self.n, step):
            yield x[i], y[i], torch.tensor(i)


def indexed(seen):
    """squared_error of ``(x, y, index)`` batches, with each sample's index as a value, noting
    the indices evaluated in ``seen`` (metric_fn runs in this process, workers or not)."""

    def metric_fn(model, batch):
        x, y, index = batch
        seen.extend(index.tolist())
        return {**squared_error(model, (x, y)), "index": index.double()}

    return metric_fn


def exact(model, n=10):
    """The mean squared error of data(n) in one batch, by hand; the mean index, 4.5 for 10."""
    x, y = data(n).tensors
    with torch.no_grad():
        return {"se": ((model.linear(x) - y) ** 2).double().mean().item(), "index": (n - 1) / 2}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_one_process_evaluates_a_stream_each_sample_once(make_trainer, num_workers):
    trainer = make_trainer()
    seen = []
    loader = DataLoader(Stream(10), batch_size=3, num_workers=num_workers)
    results = trainer.evaluate(loader, indexed(seen))
    assert sorted(seen) == list(range(10))  # with workers, their batches interleave
    want = exact(trainer.model)
    assert results == {"se": pytest.approx(want["se"], rel=1e-6), "one": 1.0, "index": 4.5}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_eval_hook_evaluates_a_stream_each_sample_once(make_trainer, num_workers):
    trainer = make_trainer(max_epochs=2)
    seen = []
    loader = DataLoader(Stream(10), batch_size=4, num_workers=num_workers)
    trainer.register_hook(EvalHook(1, data_loader=loader, metric_fn=indexed(seen)))
    trainer.train()
    assert sorted(seen) == sorted(list(range(10)) * 2)  # two evaluations
    rows = [json.loads(r) for r in open(os.path.join(trainer.work_dir, "metrics.jsonl"))]
    last = [r for r in rows if "index" in r][-1]  # after the last epoch: the final weights
    want = exact(trainer.model)
    assert (last["iter"], last["index"], last["one"]) == (16, 4.5, 1.0)  # after 16 iterations
    assert last["se"] == pytest.approx(want["se"], rel=1e-6)


def test_a_stream_that_drops_its_last_batch_is_refused(make_trainer):
    """A stream's length is unknown: whatever it holds, drop_last may leave samples out."""
    with pytest.raises(ValueError, match=r"^data_loader drops a last batch of Stream \(drop_last"):
        make_trainer().evaluate(DataLoader(Stream(10), 5, drop_last=True), indexed([]))


def test_eval_hook_logs_exact_results_and_best_checkpoint_judges_them(
    make_trainer, tmp_path, caplog
):
    def accuracy(model, batch):  # "close": an error under 1 counts as right
        se = squared_error(model, batch)["se"]
        return {"val_close": (se < 1).float(), "val_se": se}

    caplog.set_level(logging.INFO, logger="trainer")
    trainer = make_trainer(max_epochs=3)
    loader = DataLoader(data(), batch_size=3)
    hook = EvalHook(1, data_loader=loader, metric_fn=accuracy)
    trainer.register_hooks([hook, BestCheckpointHook("val_se", mode="min")])
    trainer.train()
    rows = [json.loads(r) for r in open(os.path.join(trainer.work_dir, "metrics.jsonl"))]
    evals = [r for r in rows if "val_se" in r]
    assert [r["iter"] for r in evals] == [8, 16, 24]  # after iterations 8, 16 and 24
    assert evals[-1]["val_se"] == pytest.approx(trainer.evaluate(loader, accuracy)["val_se"])
    events = EventAccumulator(trainer.tb_log_dir)
    events.Reload()
    assert [e.step for e in events.Scalars("eval/val_se")] == [8, 16, 24]
    # the summary table's rows: the best as BestCheckpointHook judges it (mode="min")
    assert re.search(r"\nval_se +final [\d.]+, best [\d.]+ \(after iteration \d+\)\n", caplog.text)
    assert re.search(r"\nbest checkpoint +\S+/best\.pth\n", caplog.text)
    assert os.path.exists(os.path.join(trainer.ckpt_dir, "best.pth"))
    # test after training, with the best weights first: one line each
    trainer.load_checkpoint(os.path.join(trainer.ckpt_dir, "best.pth"), resume=False)
    best = min(r["val_se"] for r in evals)
    assert trainer.evaluate(loader, accuracy)["val_se"] == pytest.approx(best)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "Pass EvalHook either eval_func, or data_loader and metric_fn"),
        ({"data_loader": []}, "Pass EvalHook either eval_func, or data_loader and metric_fn"),
        ({"eval_func": dict, "data_loader": [], "metric_fn": dict}, "Pass EvalHook either"),
        ({"data_loader": [], "metric_fn": 3}, "metric_fn must be callable, got int"),
        ({"data_loader": 5, "metric_fn": dict}, "data_loader must be an iterable of batches"),
        (
            {"data_loader": data(), "metric_fn": dict},
            r"iterable of batches \(a DataLoader.*got TensorDataset",
        ),
    ],
)
def test_eval_hook_takes_one_form(kwargs, message):
    with pytest.raises(TypeError, match=message):
        EvalHook(1, **kwargs)


class Evaluates(HookBase):
    """Evaluates through the trainer from a hook of its own, while training runs."""

    def __init__(self, loader):
        self.loader, self.results = loader, []

    def after_epoch(self):
        self.results.append(self.trainer.evaluate(self.loader, squared_error))


def test_a_hook_evaluates_while_training_and_training_goes_on_in_train_mode(make_trainer):
    trainer = make_trainer(max_epochs=2)
    hook = Evaluates(DataLoader(data(), batch_size=4))
    trainer.register_hook(hook)
    trainer.train()
    assert len(hook.results) == 2 and trainer.model.training


# ---- two torchrun ranks -------------------------------------------------------------------

WORKER = """
import json, sys
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from trainer import Trainer
from trainer.distributed import destroy_distributed, init_distributed
from trainer.hooks import EvalHook

rank, world = init_distributed(timeout_s=30)  # a hang fails in 30 s


class Classifier(nn.Module):
    # sample i of x = arange(5) has label i % 2; the model gets every one right but sample 0
    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(1, 1)
        with torch.no_grad():
            self.scale.weight.fill_(1.0)
            self.scale.bias.zero_()

    def logits(self, x):
        label = x.long() % 2
        predicted = torch.where(x == 0, 1 - label, label)
        return nn.functional.one_hot(predicted, 2).float() * self.scale(torch.ones_like(x)[:, None])

    def forward(self, batch):  # the loss of a batch, or the logits of inputs alone
        if isinstance(batch, torch.Tensor):
            return self.logits(batch)
        x, y = batch
        return nn.functional.cross_entropy(self.logits(x), y)


def accuracy(model, batch):
    x, y = batch
    return {"acc": (model(x).argmax(1) == y).float()}


data = TensorDataset(torch.arange(5.0), torch.arange(5) % 2)
train = DataLoader(data, batch_size=5)
results = {}
for wrapper in ("plain", "ddp", "fsdp"):
    net = model = Classifier()
    if wrapper == "ddp":
        model = DistributedDataParallel(net)
    elif wrapper == "fsdp":
        fully_shard(net.scale)  # gathers its weights in every forward, a collective
        model = fully_shard(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = Trainer(model, optimizer, None, train, max_iters=1, work_dir=sys.argv[1] + wrapper)
    for batch_size in (1, 2, 5):  # uneven: rank 0 evaluates 3, 2, 1 batches, rank 1 2, 1, 0
        results[f"{wrapper} shared {batch_size}"] = trainer.evaluate(
            DataLoader(data, batch_size=batch_size), accuracy)["acc"]
    sharded = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=False))
    results[f"{wrapper} sampler"] = trainer.evaluate(sharded, accuracy)["acc"]
    if wrapper == "ddp":  # the two EvalHook forms, in a run: their logged numbers

        def shard_mean():
            x, y = sharded.dataset[list(sharded.sampler)]
            return {"mean_of_means": (net.logits(x).argmax(1) == y).float().mean().item()}

        trainer.register_hooks([EvalHook(1, shard_mean),
                                EvalHook(1, data_loader=sharded, metric_fn=accuracy)])
        trainer.train()
        storage = trainer.metric_storage
        results["eval_func form"] = storage["mean_of_means"].latest
        results["exact form"] = storage["acc"].latest

# DDP with BatchNorm: each rank's running statistics drift after DDP's last broadcast (here set
# apart by hand); evaluation uses rank 0's, as checkpoints and DDP's next forward do
class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(1)  # its weight 1 and bias 0

    def forward(self, x):
        return self.norm(x[:, None])[:, 0]


normed = Normed()
ddp = DistributedDataParallel(normed)
normed.norm.running_mean.fill_(float(rank))
trainer = Trainer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), None, train, max_iters=1,
                  work_dir=sys.argv[1] + "bn")
normalized = lambda model, batch: {"x": model(batch[0])}
results["ddp buffers"] = trainer.evaluate(DataLoader(data, batch_size=2), normalized)["x"]
results["own buffer kept"] = normed.norm.running_mean.item() == rank
try:
    trainer.evaluate(DataLoader(data, batch_size=2, shuffle=True), normalized)
except ValueError as e:
    results["shuffled"] = str(e)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(data)


try:
    trainer.evaluate(DataLoader(Stream(), batch_size=2), normalized)
except ValueError as e:
    results["stream"] = str(e)
by_hand = torch.utils.data.Subset(data, range(rank, 5, 2))  # 3 samples on rank 0, 2 on rank 1
try:
    trainer.evaluate(DataLoader(by_hand, batch_size=1), normalized)
except ValueError as e:
    results["sharded by hand"] = str(e)
with open(f"{sys.argv[1]}-rank{rank}.json", "w") as f:  # a long line two ranks print can mix
    json.dump(results, f)
del trainer, model, net
destroy_distributed()
"""


@pytest.mark.slow
def test_two_ranks_evaluate_five_samples_exactly_with_both_loader_shapes(tmp_path):
    """5 samples on 2 ranks, 4 of them right: 0.8, as one process evaluates them, with a plain
    model, a DDP one and an FSDP2 one, whose ranks see different numbers of batches (rank 1
    none, with batches of 5) and run as many forwards. The eval_func form, averaging each
    rank's mean over its padded shard, logs 0.6667. A DDP model's buffers are rank 0's while it
    is evaluated; a shuffling loader, which orders the data by each rank's RNG, and a stream,
    which may give each rank its own part, are refused."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    cmd = torchrun_command("--nproc_per_node", "2", str(script), str(tmp_path / "work"))
    proc = popen(cmd, stdout=PIPE, stderr=PIPE, text=True, env=cpu_env())
    _, stderr = communicate(proc, timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    for rank in (0, 1):
        with open(tmp_path / f"work-rank{rank}.json") as f:
            results = json.load(f)
        assert results.pop("eval_func form") == pytest.approx(2 / 3)
        # the mean of arange(5) normalized with rank 0's running mean (0) and variance (1)
        assert results.pop("ddp buffers") == pytest.approx(2.0, rel=1e-4)
        assert results.pop("own buffer kept") is True
        assert "data_loader shuffles on each rank" in results.pop("shuffled")
        assert "data_loaders gave [3, 2] batches" in results.pop("sharded by hand")
        assert "data_loader is an IterableDataset (Stream)" in results.pop("stream")
        assert results == {name: pytest.approx(0.8) for name in results}, results
        assert len(results) == 13
