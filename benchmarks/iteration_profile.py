"""Where the Trainer's periodic work costs time: the duration of every iteration by its position
in the epoch, on the tiny MLP of overhead.py.

    python benchmarks/iteration_profile.py [--iters 4000] [--tensorboard off] [--metrics-jsonl off]

The model has epochs of 50 batches and logs every 50 iterations, so iteration 49 of each epoch is
the log point and the epoch's end, and iteration 0 the next epoch's start. For each position the
median duration over all epochs (the first 200 iterations left out) is compared with the median
of the ordinary positions (3 to 46): what is left is the cost of the log point, the epoch
boundary and the caches they cool, per epoch. Medians, so a rare slow event (a TensorBoard
hand-over every few seconds, a garbage collection) does not show; the paired benchmark's totals
include those.
"""

import argparse
import logging
import statistics
import tempfile
import time

import torch
from overhead import build

from trainer import HookBase, LoggerHook, Trainer

EPOCH = 50  # batches per epoch in overhead.build, and the log period here


class Stamps(HookBase):
    """A timestamp after every iteration (last of all hooks)."""

    priority = 1000

    def __init__(self):
        self.times = []

    def after_iter(self):
        self.times.append(time.perf_counter())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=4000)
    parser.add_argument("--tensorboard", choices=("on", "off"), default="on")
    parser.add_argument("--metrics-jsonl", choices=("on", "off"), default="on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("trainer").setLevel(logging.WARNING)
    model, optimizer, batches = build("mlp", "cpu")
    stamps = Stamps()
    with tempfile.TemporaryDirectory() as work_dir:
        trainer = Trainer(
            model, optimizer, None, batches, max_iters=args.iters, work_dir=work_dir,
            log_period=EPOCH, checkpoint_period=10**6,
        )  # fmt: skip
        trainer.unregister_hook(LoggerHook)
        trainer.register_hook(LoggerHook(
            EPOCH, tensorboard=args.tensorboard == "on", metrics_jsonl=args.metrics_jsonl == "on"
        ))  # fmt: skip
        trainer.register_hook(stamps)
        trainer.train()
    by_position = {p: [] for p in range(EPOCH)}
    for i, (a, b) in enumerate(zip(stamps.times, stamps.times[1:]), start=1):
        if i >= 4 * EPOCH:
            by_position[i % EPOCH].append(b - a)
    median = {p: statistics.median(v) * 1e6 for p, v in by_position.items()}
    ordinary = statistics.median(median[p] for p in range(3, EPOCH - 3))
    extra = {p: median[p] - ordinary for p in (EPOCH - 2, EPOCH - 1, 0, 1, 2)}
    print(f"ordinary iteration: {ordinary:.0f} us; extra time by position (us): "
          + ", ".join(f"{p}: {v:+.0f}" for p, v in extra.items())
          + f"; per epoch: {sum(extra.values()):+.0f} us "
          f"({sum(extra.values()) / (EPOCH * ordinary):.1%} of its iterations)")  # fmt: skip


if __name__ == "__main__":
    main()
