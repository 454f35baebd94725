"""How long Trainer.save_checkpoint blocks training, for a ResNet-18-sized state.

    python benchmarks/checkpoint_save.py [--saves 5] [--device cuda]

The model has ResNet-18's scale (about 12M parameters in convolutions and a 1000-way linear
layer) and SGD with momentum, so the checkpoint holds weights plus one buffer per weight.
"Blocks" is the time save_checkpoint takes to return (the copy of the state); "durable" is the
time until the background write has the file and latest.txt on disk. Each save starts after the
previous write ended, so the two do not overlap.

    python benchmarks/checkpoint_save.py --load [--state-gb 1.0] [--loads 7]

times resuming a checkpoint file of --state-gb GB (load_checkpoint: reading it, the CRC-32s of
its zip records and its checks), beside torch.load of the same file.

    python benchmarks/checkpoint_save.py --fsdp [--saves 3] [--state-gb 1.0]

times a model sharded by FSDP2 (fully_shard) on 2 gloo ranks (it launches them with torchrun;
under torchrun already, it runs on the ranks it has), with AdamW: its weights and AdamW's two
buffers hold --state-gb GB. Each save is timed twice, as one full file (every rank gathers the
whole state into rank 0's memory, rank 0 writes it) and as a sharded checkpoint (every rank
writes its shards). Per rank: the state it holds, how long save_checkpoint blocks it, how long
until its wait for the background write returns, and the peak of its resident memory during
the saves above its live memory (Linux's VmHWM, reset before each save; the live memory is the
resident memory once glibc has handed back its freed heap memory, before each mode's saves).
"""

import argparse
import contextlib
import ctypes
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from trainer import HookBase, Trainer, checkpoint_io


class ResNet18Sized(nn.Module):
    def __init__(self):
        super().__init__()
        widths = (64,) * 4 + (128,) * 4 + (256,) * 4 + (512,) * 4
        convs = [nn.Conv2d(3, 64, 7)] + [nn.Conv2d(c, c, 3) for c in widths]
        self.layers = nn.ModuleList(convs + [nn.Linear(512, 1000)])

    def forward(self, batch):
        return sum(p.sum() for p in self.parameters()) * 0.0  # a loss touching every weight


def single_process(args):
    model = ResNet18Sized().to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with tempfile.TemporaryDirectory() as work_dir:
        trainer = Trainer(model, optimizer, None, [None] * 4, max_iters=1, work_dir=work_dir)
        trainer.train()  # one step, so that the momentum buffers exist
        blocking = []
        durable = []
        for i in range(args.saves):
            start = time.perf_counter()
            trainer.save_checkpoint(f"probe_{i}.pth")
            blocking.append(time.perf_counter() - start)
            trainer.checkpointer.wait()
            durable.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    for name, times in (("blocks training", blocking), ("is durable after", durable)):
        median, low, high = (1e3 * f(times) for f in (statistics.median, min, max))
        print(
            f"{params:.1f}M parameters on {args.device}: save_checkpoint {name} {median:.0f} ms "
            f"(median of {args.saves}; min {low:.0f}, max {high:.0f})"
        )


# Loading


def loading(args):
    """How long ``load_checkpoint`` takes to resume a ``--state-gb`` GB checkpoint file (the
    weights and AdamW's two buffers), interleaved with the same without checking its records'
    CRC-32s,
    and with ``torch.load`` of the same file (the floor: reading it, without the trainer's
    checks). The file is in the page cache, as when a
    run resumes the checkpoint it just wrote: a slow disk would hide the checks' cost."""
    model = LinearStack(args.state_gb)
    optimizer = torch.optim.AdamW(model.parameters())
    with tempfile.TemporaryDirectory() as work_dir:
        trainer = Trainer(model, optimizer, None, [None] * 4, max_iters=1, work_dir=work_dir)
        trainer.train()  # one step, so that AdamW's buffers exist
        path = trainer.checkpointer.last_path
        size = os.path.getsize(path)
        resume, unchecked, floor = [], [], []
        for _ in range(args.loads):
            start = time.perf_counter()
            trainer.load_checkpoint(path)
            resume.append(time.perf_counter() - start)
            with mock.patch.object(checkpoint_io, "_check_records"):  # what the CRCs cost
                start = time.perf_counter()
                trainer.load_checkpoint(path)
                unchecked.append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.load(path, map_location="cpu", weights_only=True)
            floor.append(time.perf_counter() - start)
    print(
        f"a {size / 1e9:.2f} GB checkpoint file: load_checkpoint {spread(resume)}, "
        f"without its checksum {spread(unchecked)}, torch.load {spread(floor)} "
        f"(median (min-max) of {args.loads})"
    )


# The sharded case: FSDP2 on gloo ranks


class LinearStack(nn.Module):
    """Square linear layers, as wide as it takes to hold ``state_gb`` GB of weights and AdamW
    state (12 bytes per float32 parameter: the weight and AdamW's two buffers)."""

    def __init__(self, state_gb, depth=16):
        super().__init__()
        width = math.ceil(math.sqrt(state_gb * 1e9 / 12 / depth))
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, batch):
        x = torch.ones(4, self.layers[0].in_features)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def live_memory():
    """This process's resident memory in bytes once glibc has handed its freed heap memory back
    to the kernel: what the process holds live, without what earlier saves left for reuse."""
    ctypes.CDLL(None).malloc_trim(0)
    return _status("VmRSS")


def reset_peak_memory():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from VmRSS (Linux 4.0 and later)


def _status(field):
    with open("/proc/self/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith(f"{field}:"))
    return int(kb) * 1024


def time_saves(trainer, mode, saves):
    """This rank's (blocked s, write done s, peak bytes above the live memory) for each save in
    ``mode``. The first save allocates its buffers afresh; later ones may reuse memory that
    glibc kept, as the saves of a long run do."""
    trainer.checkpointer.sharded = mode == "sharded"
    live = live_memory()
    out = []
    for i in range(saves):
        dist.barrier()  # the ranks start together: no rank times another's lateness
        reset_peak_memory()
        start = time.perf_counter()
        path = trainer.save_checkpoint(f"probe_{mode}_{i}.pth")
        blocked = time.perf_counter() - start
        trainer.checkpointer.wait()
        out.append((blocked, time.perf_counter() - start, _status("VmHWM") - live))
        dist.barrier()  # every rank's write is done
        if path is not None and os.path.isdir(path):  # rank 0: one checkpoint on disk at a time
            shutil.rmtree(path)
        elif path is not None:
            os.remove(path)
    return out


def sharded(args):
    from torch.distributed.fsdp import fully_shard

    from trainer.distributed import init_distributed, is_dtensor

    rank, world_size = init_distributed(backend="gloo")  # CPU tensors, even beside GPUs
    with torch.device("meta"):  # no rank ever holds the whole model
        model = LinearStack(args.state_gb)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # the same on every rank; the values do not matter here
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(std=p.shape[1] ** -0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory() if rank == 0 else contextlib.nullcontext() as made:
        shared = [made]
        dist.broadcast_object_list(shared)  # one folder for every rank's files
        trainer = Trainer(
            model, optimizer, None, [None] * 4, max_iters=2, work_dir=shared[0], checkpoint_period=0
        )
        measured = {}

        class Saves(HookBase):  # in training, where sharded saves write in the background
            def after_iter(self):
                if trainer.cur_iter == 0:  # after one step, so that AdamW's buffers exist
                    modes = ("full", "sharded")
                    measured.update((mode, time_saves(trainer, mode, args.saves)) for mode in modes)

        trainer.register_hook(Saves())
        trainer.train()
        buffers = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
        local = [t.to_local() if is_dtensor(t) else t for t in [*model.parameters(), *buffers]]
        held = sum(t.nbytes for t in local)
        times = measured
        dist.barrier()  # every rank is done with the folder before rank 0 removes it
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (held, times))
    if rank == 0:
        params = sum(p.numel() for p in model.parameters()) / 1e6
        total = sum(h for h, _ in everyone)
        report(everyone, params, total, world_size, args.saves)
    # Every rank done talking, then tear down and leave without the interpreter's teardown,
    # where a gloo thread could still hold a tensor (docs/internals.md: gloo teardown).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(everyone, params, total, world_size, saves):
    print(
        f"{params:.1f}M parameters in FSDP2 shards on {world_size} gloo ranks, with AdamW: "
        f"{total / 1e6:.0f} MB of state; times: the median (min-max) of {saves} saves per mode"
    )
    print(
        "| mode | rank | state held | save_checkpoint blocks training | until its wait for the "
        "write returns | peak host memory above the live memory |"
    )
    print("|---|---|---|---|---|---|")
    for mode in ("full", "sharded"):
        for rank, (held, times) in enumerate(everyone):
            blocked, done, peak = zip(*times[mode])
            print(
                f"| {mode} | {rank} | {held / 1e6:.0f} MB | {spread(blocked)} | {spread(done)} | "
                f"{max(peak) / 1e6:.0f} MB |"
            )
    for mode in ("full", "sharded"):
        slowest = [max(times[mode][i][1] for _, times in everyone) for i in range(saves)]
        print(f"{mode}: the checkpoint is complete after {spread(slowest)} (the slowest rank's)")


def spread(seconds):
    """``median ms (min-max)``."""
    median, low, high = (1e3 * f(seconds) for f in (statistics.median, min, max))
    return f"{median:.0f} ms ({low:.0f}-{high:.0f})"


def launch_ranks():
    """Run this script again, with the same arguments, on 2 ranks under torchrun."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc_per_node", "2", os.path.abspath(__file__), *sys.argv[1:]]
    # one intra-op thread per rank, as torchrun would set (without its banner)
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    sys.exit(subprocess.run(cmd, env=env, check=False).returncode)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=None, help="5; 3 with --fsdp")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 on gloo ranks, CPU")
    parser.add_argument("--state-gb", type=float, default=1.0, help="with --fsdp or --load")
    parser.add_argument("--load", action="store_true", help="time resuming a --state-gb file")
    parser.add_argument("--loads", type=int, default=7, help="with --load")
    args = parser.parse_args()
    if args.fsdp and args.device != "cpu":
        parser.error("--fsdp runs on CPU (gloo ranks); drop --device.")
    if args.load and (args.fsdp or args.device != "cpu"):
        parser.error("--load times a checkpoint file on CPU; drop --fsdp and --device.")
    args.saves = args.saves or (3 if args.fsdp else 5)
    logging.getLogger("trainer").setLevel(logging.WARNING)
    if args.load:
        loading(args)
    elif not args.fsdp:
        single_process(args)
    elif "RANK" not in os.environ:
        launch_ranks()
    else:
        sharded(args)


if __name__ == "__main__":
    main()
