"""How long Trainer.save_checkpoint blocks training, for a ResNet-18-sized state.

    python benchmarks/checkpoint_save.py [--saves 5] [--device cuda]

The model has ResNet-18's scale (about 12M parameters in convolutions and a 1000-way linear
layer) and SGD with momentum, so the checkpoint holds weights plus one buffer per weight.
"Blocks" is the time save_checkpoint takes to return (the copy of the state); "durable" is the
time until the background write has the file and latest.txt on disk. Each save starts after the
previous write ended, so the two do not overlap.
"""

import argparse
import logging
import statistics
import tempfile
import time

import torch
from torch import nn

from trainer import Trainer


class ResNet18Sized(nn.Module):
    def __init__(self):
        super().__init__()
        widths = (64,) * 4 + (128,) * 4 + (256,) * 4 + (512,) * 4
        convs = [nn.Conv2d(3, 64, 7)] + [nn.Conv2d(c, c, 3) for c in widths]
        self.layers = nn.ModuleList(convs + [nn.Linear(512, 1000)])

    def forward(self, batch):
        return sum(p.sum() for p in self.parameters()) * 0.0  # a loss touching every weight


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    logging.getLogger("trainer").setLevel(logging.WARNING)
    model = ResNet18Sized().to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with tempfile.TemporaryDirectory() as work_dir:
        trainer = Trainer(model, optimizer, None, [None] * 4, max_iters=1, work_dir=work_dir)
        trainer.train()  # one step, so that the momentum buffers exist
        blocking, durable = [], []
        for i in range(args.saves):
            start = time.perf_counter()
            trainer.save_checkpoint(f"probe_{i}.pth")
            blocking.append(time.perf_counter() - start)
            trainer.checkpointer.wait()
            durable.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    for name, times in (("blocks training", blocking), ("is durable after", durable)):
        median, low, high = (1e3 * f(times) for f in (statistics.median, min, max))
        print(f"{params:.1f}M parameters on {args.device}: save_checkpoint {name} {median:.0f} ms "
              f"(median of {args.saves}; min {low:.0f}, max {high:.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
