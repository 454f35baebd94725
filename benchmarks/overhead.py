"""The Trainer's overhead against hand-written loops, measured side by side.

    python benchmarks/overhead.py                     # CPU: tiny MLP, and DDP on 2 gloo processes
    python benchmarks/overhead.py --device cuda       # CUDA: tiny MLP, conv net fp32 and AMP
    python benchmarks/overhead.py --workloads mlp --repeats 7 --lengths 1000 3000

Every measurement runs in its own process. The implementations are interleaved (A B C A B C ...),
each at two run lengths; the steady-state rate is (long - short) / (t_long - t_short), so imports
and start-up cancel, and start-up is reported apart. A child times itself from after building the
model and the data (the same in every implementation) to the end of training, the Trainer's
construction and its final checkpoint included. Reported: medians over the repeats, their spread,
the ratio to the sync-free hand-written loop, and peak CUDA memory.

Implementations:
    raw        the hand-written loop a careful engineer writes: no host sync at all
    raw_item   the same loop calling loss.item() every step (what most loops do)
    trainer    trainer.Trainer with its default hooks, logging every 50 iterations; it saves
               one checkpoint, at the end (the cost of a save is measured apart)
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

IMPLEMENTATIONS = ("raw", "raw_item", "trainer")
# name: (device, AMP, processes)
WORKLOADS = {
    "mlp": ("any", False, 1),
    "conv": ("cuda", False, 1),
    "conv_amp": ("cuda", True, 1),
    "ddp": ("cpu", False, 2),
}


# ---- one measurement, in a child process ---------------------------------------------------


def build(workload, device):
    """The model (returning its loss), an optimizer and 50 batches already on the device."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if workload.startswith("conv"):
        body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
        )  # fmt: skip
        shape, batch_size = (3, 32, 32), 256
    else:
        body = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        shape, batch_size = (64,), 64

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body

        def forward(self, batch):
            x, y = batch
            return nn.functional.cross_entropy(self.body(x), y)

    model = WithLoss().to(device)
    batches = [
        (torch.randn(batch_size, *shape), torch.randint(0, 10, (batch_size,))) for _ in range(50)
    ]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, optimizer, batches


def child(impl, workload, device, iters):
    import torch

    from trainer.distributed import get_rank, init_distributed

    _, world_size = init_distributed()
    amp = WORKLOADS[workload][1]
    model, optimizer, batches = build(workload, device)
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if impl == "trainer":
        import logging

        from trainer import Trainer

        logging.getLogger("trainer").setLevel(logging.WARNING)
        with tempfile.TemporaryDirectory() as work_dir:
            trainer = Trainer(
                model, optimizer, None, batches, max_iters=iters, work_dir=work_dir,
                log_period=50, enable_amp=amp, checkpoint_period=10**6,
            )  # fmt: skip
            trainer.train()
    else:
        scaler = torch.amp.GradScaler(device, enabled=amp and device == "cuda")
        for it in range(iters):
            batch = batches[it % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, torch.float16 if device == "cuda" else torch.bfloat16,
                                enabled=amp):  # fmt: skip
                loss = model(batch)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if impl == "raw_item":
                loss.item()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    if get_rank() == 0:
        print(json.dumps({"seconds": seconds, "peak_mem": peak}))
    if world_size > 1:
        # Every rank done talking, then tear down: gloo can abort at exit otherwise.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# ---- the driver ----------------------------------------------------------------------------


def measure(impl, workload, device, iters):
    args = [__file__, "--child", impl, workload, device, str(iters)]
    if WORKLOADS[workload][2] > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] + args
    else:
        cmd = [sys.executable] + args
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def benchmark(workload, device, repeats, lengths):
    short, long = lengths
    runs = {impl: [] for impl in IMPLEMENTATIONS}
    for _ in range(repeats):
        for impl in IMPLEMENTATIONS:  # interleaved, so drifts in machine speed hit all alike
            a = measure(impl, workload, device, short)
            b = measure(impl, workload, device, long)
            rate = (long - short) / (b["seconds"] - a["seconds"])
            runs[impl].append(
                {"rate": rate, "startup": a["seconds"] - short / rate, "peak": b["peak_mem"]}
            )
    rows = []
    raw_rate = statistics.median(r["rate"] for r in runs["raw"])
    raw_peak = statistics.median(r["peak"] for r in runs["raw"])
    for impl in IMPLEMENTATIONS:
        rates = [r["rate"] for r in runs[impl]]
        peak = statistics.median(r["peak"] for r in runs[impl])
        rows.append(
            {
                "impl": impl,
                "rate": statistics.median(rates),
                "spread": (min(rates), max(rates)),
                "ratio": statistics.median(rates) / raw_rate,
                "startup": statistics.median(r["startup"] for r in runs[impl]),
                "peak_ratio": peak / raw_peak if raw_peak else None,
            }
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=4, metavar=("IMPL", "WORKLOAD", "DEVICE", "ITERS"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--workloads", nargs="+", default=None, choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs=2, default=(2000, 6000))
    args = parser.parse_args()
    if args.child:
        impl, workload, device, iters = args.child
        return child(impl, workload, device, int(iters))

    workloads = args.workloads or [
        name for name, (device, _, _) in WORKLOADS.items() if device in ("any", args.device)
    ]
    print(f"{time.strftime('%Y-%m-%d')}, device {args.device}, {args.repeats} repeats, "
          f"lengths {args.lengths[0]} and {args.lengths[1]} iterations")  # fmt: skip
    print("| workload | implementation | steps/s (median) | spread | ratio to raw | start-up s "
          "| peak memory ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for workload in workloads:
        for row in benchmark(workload, args.device, args.repeats, args.lengths):
            peak = "-" if row["peak_ratio"] is None else f"{row['peak_ratio']:.3f}"
            print(
                f"| {workload} | {row['impl']} | {row['rate']:.0f} | {row['spread'][0]:.0f}-"
                f"{row['spread'][1]:.0f} | {row['ratio']:.3f} | {row['startup']:.2f} | {peak} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
