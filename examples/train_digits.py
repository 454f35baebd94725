"""Train a small CNN on scikit-learn's bundled digits dataset (no download).

    python examples/train_digits.py
    torchrun --nproc_per_node 2 examples/train_digits.py
    # two nodes (here both on localhost): run on each, with the first node's address
    torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d --rdzv-endpoint localhost:29500 \
        --rdzv-id digits examples/train_digits.py

The same file runs in one process or under torchrun: ``init_distributed`` joins the process group
torchrun describes (gloo on CPU, nccl on GPUs), the model is wrapped in DistributedDataParallel and
the training set is split between ranks by a DistributedSampler; ``Trainer.evaluate`` shares the
test batches between them and counts every test sample once. It trains on the GPU when there is
one. Rerunning resumes from the latest checkpoint in ``--work-dir``.
"""

import argparse
import logging
import os

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainer import Trainer, set_random_seed, setup_logger
from trainer.distributed import destroy_distributed, get_world_size, init_distributed
from trainer.hooks import EvalHook

logger = logging.getLogger("train_digits")


class DigitsNet(nn.Module):
    """A two-layer CNN for 8x8 digits that returns the cross-entropy loss of a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.2),
        )  # fmt: skip
        self.classifier = nn.Linear(64 * 4 * 4, 10)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.logits(images), labels)


def load_data(seed: int, device: torch.device) -> tuple[TensorDataset, TensorDataset]:
    """The digits split 80/20, already on ``device`` (the set is tiny)."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=0.2, random_state=seed, stratify=digits.target
    )
    return (
        TensorDataset(images[train_idx].to(device), labels[train_idx].to(device)),
        TensorDataset(images[test_idx].to(device), labels[test_idx].to(device)),
    )


def accuracy(model: DigitsNet, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Per sample, for Trainer.evaluate: 1.0 where the digit is recognised."""
    images, labels = batch
    return {"test_acc": (model.logits(images).argmax(1) == labels).float()}


@record  # under torchrun: a failing rank's traceback goes into torchrun's error summary
def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--work-dir", default="work_dir/digits")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rank, world_size = init_distributed()
    setup_logger("train_digits", rank=rank)
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1 for its workers
        # A network this small runs about as fast on one intra-op thread (6.8 s against 6.2 s
        # on 2 idle cores), and two wait for each other at every operation when another job
        # holds a core: 2 to 40 times slower (docs/performance.md, "Small models on a shared
        # CPU").
        torch.set_num_threads(1)
        logger.info("One intra-op thread for this small network (OMP_NUM_THREADS=N sets N).")
    set_random_seed(args.seed + rank)  # per-rank dropout; the data split uses args.seed alone
    # init_distributed bound this process to its GPU, if any
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    train_set, test_set = load_data(args.seed, device or torch.device("cpu"))
    sampler = DistributedSampler(train_set, seed=args.seed) if world_size > 1 else None
    loader = DataLoader(
        train_set, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler
    )

    net = DigitsNet().to(device)
    model = DistributedDataParallel(net, device_ids=device and [device]) if world_size > 1 else net
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    trainer = Trainer(
        model, optimizer, scheduler, loader, max_epochs=args.epochs,
        work_dir=args.work_dir, log_period=20, max_num_checkpoints=2,
        warmup_t=len(loader), warmup_init_lr=args.lr / 10,
    )  # fmt: skip
    # Exact under torchrun too: the ranks share the test batches, and every test sample
    # counts once, as in one process.
    test_loader = DataLoader(test_set, batch_size=256)
    trainer.register_hook(EvalHook(5, data_loader=test_loader, metric_fn=accuracy))
    trainer.train()

    acc = trainer.evaluate(test_loader, accuracy)["test_acc"]
    logger.info(f"Final test accuracy: {acc:.4f} (world size {get_world_size()})")
    return acc


if __name__ == "__main__":
    main()
    destroy_distributed()  # after main() returned (docs/internals.md: gloo teardown)
