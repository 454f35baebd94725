"""The Trainer's overhead on the tiny MLP, paired in one process so that machine drift cancels.

    python benchmarks/paired_overhead.py [--iters 6000] [--device cpu] [--step flat]

overhead.py's separate processes are the reference method, but on a small shared VM the machine's
speed drifts by 10-20% over seconds, more than the few percent being measured. Here a hook, after
every epoch of 50 iterations, times the Trainer's epoch (one log point and the epoch's start and
end included) and then 50 iterations of the hand-written loop on the same model, optimizer and
batches; the two halves of each pair run within a tenth of a second of each other. Reported: the
median ratio (hand-written time / Trainer time, i.e. Trainer steps/s over hand-written steps/s)
and its quartiles. The hand-written half runs right after the Trainer's, so the comparison is not
perfectly symmetric; treat differences below 1% as noise.

``--step flat`` is an experiment, not a way to train: the Trainer's step replaced by the
hand-written one (reaching into private attributes, for the plain configuration only), with the
loop, hooks and logging kept, to measure what the layers of the built-in step cost.
"""

import argparse
import logging
import statistics
import tempfile
import time

import torch
from overhead import build

from trainer import HookBase, Trainer

CHUNK = 50  # iterations per half of a pair: one epoch of overhead.build's 50 batches, and one log
# period


class PairedTiming(HookBase):
    """After every epoch (CHUNK iterations): time it, then time CHUNK hand-written iterations."""

    priority = 100  # after every built-in hook, so the Trainer's half includes their work

    def __init__(self, hand_written, skip_epochs):
        self._hand_written = hand_written
        self._skip_epochs = skip_epochs
        self._start = None
        self.pairs = []

    # At epoch ends, not after every iteration: a probe in the loop would add its own cost to
    # the Trainer's half alone.
    def after_epoch(self):
        trainer_seconds = time.perf_counter() - (self._start or 0.0)
        if self._start is not None and self.trainer.cur_epoch >= self._skip_epochs:
            self.pairs.append((trainer_seconds, self._hand_written()))
        self._start = time.perf_counter()


def paired_ratios(trainer: Trainer, hand_written, skip_epochs: int) -> list[float]:
    """Train ``trainer`` with a :class:`PairedTiming` hook; each pair's ratio of the hand-written
    half's time to the Trainer's (the Trainer's steps/s over the hand-written loop's)."""
    timing = PairedTiming(hand_written, skip_epochs)
    trainer.register_hook(timing)
    trainer.train()
    return [raw / ours for ours, raw in timing.pairs]


def summary(ratios: list[float], chunk: int) -> str:
    """The median ratio and its quartiles, as the paired benchmarks print them."""
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return (
        f"Trainer / hand-written steps/s, paired: median {median:.3f} (quartiles {q1:.3f}-"
        f"{q3:.3f}, {len(ratios)} pairs of {chunk} iterations)"
    )


class FlatStepTrainer(Trainer):
    """The built-in step without its layers (no AMP, accumulation, clipping or DDP)."""

    def train_one_iter(self):
        batch = self._data.next_batch()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(batch)
        logged = loss.detach()
        loss.backward()
        self.optimizer.step()
        self._storage.add(self.cur_iter, {"total_loss": logged}, check_finite=True, reduce=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=6000)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--step", default="builtin", choices=("builtin", "flat"))
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # as in overhead.py
    logging.getLogger("trainer").setLevel(logging.WARNING)
    model, optimizer, batches = build("mlp", args.device)

    def hand_written():
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in batches[:CHUNK]:
            optimizer.zero_grad(set_to_none=True)
            model(batch).backward()
            optimizer.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as work_dir:
        trainer_class = FlatStepTrainer if args.step == "flat" else Trainer
        trainer = trainer_class(
            model,
            optimizer,
            None,
            batches,
            max_iters=args.iters,
            work_dir=work_dir,
            log_period=CHUNK,
            checkpoint_period=10**6,
        )
        ratios = paired_ratios(trainer, hand_written, skip_epochs=4)
    print(f"{args.device}: {summary(ratios, CHUNK)}")


if __name__ == "__main__":
    main()
