"""What a mid-epoch resume costs: the time from ``train()`` to the first resumed step, and the
samples loaded before it, resuming at 90% of an epoch.

    python benchmarks/resume_cost.py [--workers 0 2] [--repeats 3] [--item-ms 1]

The dataset's ``__getitem__`` sleeps ``--item-ms`` (a stand-in for decoding and augmenting a
sample); epochs are 100 iterations of batches of 4, shuffled. A first run saves a checkpoint
after iteration 90 and is interrupted; the timed run resumes from it and stops after its first
step. "From scratch" is the same measurement for a run with nothing to resume (a fresh
``work_dir``): what any start costs. Reported: medians over the repeats.
"""

import argparse
import logging
import multiprocessing
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer import CheckpointHook, HookBase, LoggerHook, Trainer

ITERS_PER_EPOCH, BATCH, RESUME_AT = 100, 4, 90


class SlowDataset(Dataset):
    """Samples that take ``item_ms`` each to load, counted across worker processes."""

    def __init__(self, item_ms: float) -> None:
        self.item_s = item_ms / 1000
        self.loads = multiprocessing.Value("i", 0)
        g = torch.Generator().manual_seed(0)
        n = ITERS_PER_EPOCH * BATCH
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.item_s)
        with self.loads.get_lock():
            self.loads.value += 1
        return self.x[i], self.y[i]


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 1)

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)


class StopAfter(HookBase):
    """Interrupts training after iteration ``last``, noting when its step ended."""

    priority = 100  # after CheckpointHook, so the checkpoint of that iteration is taken

    def __init__(self, last: int) -> None:
        self.last = last
        self.time = self.loads = None

    def after_iter(self) -> None:
        if self.trainer.cur_iter >= self.last:
            self.time = time.perf_counter()
            raise KeyboardInterrupt


def run(work_dir: str, dataset: SlowDataset, workers: int, stop_after: int) -> tuple[float, int]:
    """Train in ``work_dir`` until iteration ``stop_after``; the seconds from ``train()`` to the
    first step's end, and the samples loaded by then."""
    torch.manual_seed(0)
    model = Regression()
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), None, loader, max_epochs=2,
        work_dir=work_dir, checkpoint_period=0, log_period=1000,
    )  # fmt: skip
    trainer.register_hook(CheckpointHook(RESUME_AT, 3, by_epoch=False))
    trainer.unregister_hook(LoggerHook)
    trainer.register_hook(LoggerHook(1000, tensorboard=False, metrics_jsonl=False))
    first = StopAfter(stop_after)
    trainer.register_hook(first)
    dataset.loads.value = 0
    start = time.perf_counter()
    try:
        trainer.train()
    except SystemExit:  # how train() ends on an interrupt
        pass
    return first.time - start, dataset.loads.value


def measure(workers: int, item_ms: float) -> dict[str, float]:
    dataset = SlowDataset(item_ms)
    with tempfile.TemporaryDirectory() as resumed, tempfile.TemporaryDirectory() as fresh:
        run(resumed, dataset, workers, RESUME_AT - 1)  # saves iter_90.pth, then stops
        resume_s, resume_loads = run(resumed, dataset, workers, RESUME_AT)
        fresh_s, fresh_loads = run(fresh, dataset, workers, 0)
    return {"resume_s": resume_s, "resume_loads": resume_loads, "fresh_s": fresh_s,
            "fresh_loads": fresh_loads}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--item-ms", type=float, default=1.0)
    args = parser.parse_args()
    logging.getLogger("trainer").setLevel(logging.WARNING)
    print(
        f"Resuming at iteration {RESUME_AT} of a {ITERS_PER_EPOCH}-iteration epoch (batch "
        f"{BATCH}, {args.item_ms:g} ms per sample), medians of {args.repeats} repeats:"
    )
    print("| workers | train() to first resumed step | samples loaded before it | "
          "from scratch: to first step | samples loaded |")  # fmt: skip
    print("|---|---|---|---|---|")
    for workers in args.workers:
        runs = [measure(workers, args.item_ms) for _ in range(args.repeats)]
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {workers} | {m['resume_s']:.3f} s | {m['resume_loads']:.0f} | "
              f"{m['fresh_s']:.3f} s | {m['fresh_loads']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
