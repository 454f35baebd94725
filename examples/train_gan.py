"""A GAN on 2-D toy data (8 Gaussians on a circle, made on the spot): subclass the Trainer,
override ``train_one_iter``, and keep every feature.

    python examples/train_gan.py
    torchrun --nproc_per_node 2 examples/train_gan.py

The override uses the trainer's public building blocks only: ``autocast()`` (bfloat16 on CPU,
float16 on CUDA, where ``backward()`` scales the loss for the GradScaler), ``clip_and_step()``
for each of the two optimizers (which logs ``grad_norm`` and ``grad_norm/optimizer_d``), and
``log_losses()``, whose values are NaN-checked and averaged over ranks at log points. The
discriminator's optimizer is checkpointed through ``checkpointer.register``, so a killed run
resumes exactly. Under torchrun the generator and
the discriminator are each wrapped in DistributedDataParallel.
"""

import argparse
import logging
import math
from typing import Optional

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainer import EvalHook, Trainer, set_random_seed, setup_logger
from trainer.distributed import destroy_distributed, get_world_size, init_distributed

logger = logging.getLogger("train_gan")
LATENT = 8  # the generator's noise dimension


def ring_of_gaussians(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` points around 8 modes on the unit circle (standard deviation 0.05)."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.randint(0, 8, (n,), generator=g) * (2 * math.pi / 8)
    centers = torch.stack([angles.cos(), angles.sin()], dim=1)
    return centers + 0.05 * torch.randn(n, 2, generator=g)


def mlp(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
        nn.Linear(64, outputs),
    )  # fmt: skip


class GAN(nn.Module):
    """The generator and the discriminator: the module whose weights checkpoints hold."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = mlp(LATENT, 2)
        self.discriminator = mlp(2, 1)


class GANTrainer(Trainer):
    """Alternates a discriminator step and a generator step in every iteration.

    Args:
        gan: The two networks (plain modules).
        opt_g: The generator's optimizer: the trainer's own.
        opt_d: The discriminator's optimizer, checkpointed as ``optimizer_d``.
        loader: Batches of real points.
        ddp: Wrap each network in DistributedDataParallel (under torchrun).
        kwargs: More Trainer arguments.
    """

    def __init__(self, gan: GAN, opt_g, opt_d, loader, ddp: bool = False, **kwargs) -> None:
        super().__init__(gan, opt_g, None, loader, **kwargs)
        wrap = DistributedDataParallel if ddp else (lambda module: module)
        self.generator, self.discriminator = wrap(gan.generator), wrap(gan.discriminator)
        self.opt_d = opt_d
        self.checkpointer.register("optimizer_d", opt_d)

    def train_one_iter(self) -> None:
        # 1. fetch real points, draw noise
        (real,) = self.next_batch()
        noise = torch.randn(len(real), LATENT, device=real.device)
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)]).to(real.device)
        bce = nn.functional.binary_cross_entropy_with_logits

        # 2. discriminator: real points against generated ones (no gradient into the generator)
        self.opt_d.zero_grad(set_to_none=True)
        with torch.no_grad(), self.autocast():
            fake = self.generator(noise)
        with self.autocast():
            logits = self.discriminator(torch.cat([real, fake.to(real.dtype)]))
            d_loss = bce(logits.float(), labels)
        self.backward(d_loss)
        self.clip_and_step(self.opt_d)

        # 3. generator: make the discriminator call its points real
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            g_loss = bce(self.discriminator(self.generator(noise)).float(), labels[: len(real)])
        self.backward(g_loss)
        self.clip_and_step()  # the trainer's optimizer: the generator's
        # (the trainer updates the float16 loss scale after train_one_iter, both steps done)

        # 4. log: NaN-checked and averaged over ranks at the next log point, no sync now
        self.log_losses(d_loss=d_loss.detach(), g_loss=g_loss.detach())


@torch.no_grad()
def mode_distance(gan: GAN, device: torch.device) -> float:
    """The mean distance of 1000 generated points to the circle of modes (0 is perfect)."""
    noise = torch.randn(1000, LATENT, generator=torch.Generator().manual_seed(1)).to(device)
    points = gan.generator(noise)
    return (points.norm(dim=1) - 1).abs().mean().item()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--work-dir", default="work_dir/gan")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_trainer(args: argparse.Namespace) -> GANTrainer:
    """The trainer for ``args``; under torchrun, call ``init_distributed()`` first."""
    rank, world_size = init_distributed()
    set_random_seed(args.seed + rank)  # each rank its own noise
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    data = TensorDataset(ring_of_gaussians(2048, args.seed).to(device))
    sampler = DistributedSampler(data, seed=args.seed) if world_size > 1 else None
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    gan = GAN().to(device)
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    trainer = GANTrainer(
        gan, opt_g, opt_d, loader, ddp=world_size > 1, max_epochs=args.epochs,
        work_dir=args.work_dir, log_period=32, max_num_checkpoints=2, enable_amp=True,
        clip_grad_norm=1.0,
    )  # fmt: skip
    device = device or torch.device("cpu")
    trainer.register_hook(EvalHook(10, lambda: {"mode_distance": mode_distance(gan, device)}))
    return trainer


@record  # under torchrun: a failing rank's traceback goes into torchrun's error summary
def main(argv: Optional[list[str]] = None) -> float:
    args = parse_args(argv)
    trainer = build_trainer(args)
    setup_logger("train_gan", rank=torch.distributed.get_rank() if get_world_size() > 1 else 0)
    trainer.train()
    distance = trainer.metric_storage["mode_distance"].latest
    logger.info(
        f"Final mode distance: {distance:.4f} (world size {get_world_size()}, AMP "
        f"{trainer.run_config['amp_dtype'] or 'off'})"
    )
    return distance


if __name__ == "__main__":
    main()
    destroy_distributed()  # after main() returned (docs/internals.md: gloo teardown)
