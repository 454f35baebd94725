"""The Trainer's overhead on a ResNet-18-class conv net on CPU, in mixed precision, paired in one
process as paired_overhead.py pairs the tiny MLP's.

    python benchmarks/paired_resnet.py [--iters 840] [--batch-size 16] [--threads 1]

The tiny MLP's step is launch-bound: a millisecond of torch work, so every microsecond of the
Trainer's Python shows. This is the other end, a step of real work: ResNet-18's layout (a stem,
four stages of two basic blocks, the image halved and the channels doubled at each stage after
the first) at a quarter of its widths (16 to 128 channels), on 32x32 images in batches of 16,
channels_last, the forward under bfloat16 autocast (``enable_amp=True`` on CPU), SGD with
momentum. Each pair times an epoch of the Trainer (20 iterations, one log point) and then 20
iterations of the hand-written loop on the same model, optimizer and batches; the first two
epochs warm up. Reported: the median ratio of the pairs (Trainer steps/s over hand-written
steps/s) and its quartiles. About 2 minutes on one core of the 2-core development VM.
"""

import argparse
import logging
import tempfile
import time

import torch
from paired_overhead import paired_ratios, summary
from torch import nn

from trainer import Trainer

CHUNK = 20  # iterations per half of a pair: one epoch of the 20 batches, and one log period
WIDTHS = (16, 32, 64, 128)  # ResNet-18's 64, 128, 256, 512, divided by 4


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norms, and the input added back (through a strided 1x1
    convolution where the shape changes)."""

    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images (a 3x3 stem, no max pool) with ``widths`` channels in its four
    stages; returns the cross-entropy loss of an ``(images, labels)`` batch."""

    def __init__(self, widths=WIDTHS, classes: int = 10) -> None:
        super().__init__()
        layers = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0])]
        layers.append(nn.ReLU())
        channels = widths[0]
        for stage, width in enumerate(widths):
            stride = 1 if stage == 0 else 2
            layers += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
            channels = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, batch) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=840)  # 2 warm-up epochs, then 40 pairs
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)  # as paired_overhead.py: less noise
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("trainer").setLevel(logging.WARNING)
    torch.manual_seed(0)
    model = ResNet18().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = [
        (
            torch.randn(args.batch_size, 3, 32, 32).to(memory_format=torch.channels_last),
            torch.randint(0, 10, (args.batch_size,)),
        )
        for _ in range(CHUNK)
    ]

    def hand_written():
        start = time.perf_counter()
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(batch)
            loss.backward()
            optimizer.step()
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as work_dir:
        trainer = Trainer(
            model,
            optimizer,
            None,
            batches,
            max_iters=args.iters,
            work_dir=work_dir,
            log_period=CHUNK,
            checkpoint_period=10**6,
            enable_amp=True,  # bfloat16 on CPU, no GradScaler
        )
        ratios = paired_ratios(trainer, hand_written, skip_epochs=2)
    print(f"ResNet-18 class, CPU, bfloat16: {summary(ratios, CHUNK)}")


if __name__ == "__main__":
    main()
