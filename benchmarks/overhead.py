"""The Trainer's overhead against hand-written loops, measured side by side.

    python benchmarks/overhead.py                     # CPU: tiny MLP, and DDP on 2 gloo processes
    python benchmarks/overhead.py --device cuda       # CUDA: tiny MLP, conv net fp32 and AMP
    python benchmarks/overhead.py --workloads mlp --repeats 7 --lengths 1000 3000

One command runs the suite: the timing table, then the syncs and collectives the Trainer makes per
iteration, then the blocking time of a checkpoint save (benchmarks/checkpoint_save.py).

Every measurement runs in its own process. The implementations are interleaved (A B C A B C ...),
each at two run lengths; the steady-state rate is (long - short) / (t_long - t_short), so imports
and start-up cancel, and start-up is reported apart. A child times itself from after building the
model and the data (the same in every implementation) to the end of training, the Trainer's
construction and its final checkpoint included. Reported: medians over the repeats, their spread,
the ratio to the sync-free hand-written loop, and peak CUDA memory. On CPU each process uses one
intra-op thread (--threads): the workload is launch-bound, and on a small shared machine a second
thread mostly adds noise (a stall of either core stalls every parallel op).

Counts (one more Trainer process per workload, at N and 2N iterations, so start-up and the final
checkpoint cancel): host reads (Tensor.item, float(), bool(), int(), .tolist(), .cpu(), .numpy()),
torch.distributed calls made from Python (DDP's gradient all-reduce runs in C++ and is not
counted), and on CUDA the syncs that torch.cuda.set_sync_debug_mode("warn") reports.

Implementations:
    raw        the hand-written loop a careful engineer writes: no host sync at all
    raw_item   the same loop calling loss.item() every step (what most loops do)
    trainer    trainer.Trainer with its default hooks, logging every 50 iterations; it saves
               one checkpoint, at the end (the cost of a save is measured apart)
    trainer_graph  (CUDA) the same with cuda_graph=True and SGD(fused=True), which a CUDA graph
               can hold with a tensor LR; its ratio is against the eager hand-written loop
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

IMPLEMENTATIONS = ("raw", "raw_item", "trainer")
GRAPH_IMPLEMENTATIONS = ("trainer_graph",)  # CUDA only
# name: (device, AMP, processes)
WORKLOADS = {
    "mlp": ("any", False, 1),
    "conv": ("cuda", False, 1),
    "conv_amp": ("cuda", True, 1),
    "ddp": ("cpu", False, 2),
}


# ---- one measurement, in a child process ---------------------------------------------------


def build(workload, device, fused=None):
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
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=fused)
    return model, optimizer, batches


def child(impl, workload, device, iters, threads):
    import torch

    from trainer.distributed import get_rank, init_distributed

    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    _, world_size = init_distributed()
    amp = WORKLOADS[workload][1]
    model, optimizer, batches = build(workload, device, fused=impl == "trainer_graph" or None)
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    counts = {}
    if impl in ("trainer", "trainer_graph", "count"):
        with counting(device, enabled=impl == "count") as counts:
            run_trainer(model, optimizer, batches, iters, amp, impl == "trainer_graph")
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
        print(json.dumps({"seconds": seconds, "peak_mem": peak, **counts}))
    if world_size > 1:
        # Every rank done talking, then tear down: gloo can abort at exit otherwise. Even so, a
        # gloo thread was seen aborting the interpreter's exit now and then ("terminate called
        # without an active exception"); the measurement is done, so skip the exit's destructors.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


def run_trainer(model, optimizer, batches, iters, amp, cuda_graph=False):
    import logging

    from trainer import Trainer

    logging.getLogger("trainer").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as work_dir:
        trainer = Trainer(
            model, optimizer, None, batches, max_iters=iters, work_dir=work_dir,
            log_period=50, enable_amp=amp, checkpoint_period=10**6, cuda_graph=cuda_graph,
        )  # fmt: skip
        trainer.train()


@contextlib.contextmanager
def counting(device, enabled):
    """Count host reads, Python-level collectives and (on CUDA) syncs inside the block."""
    import torch
    import torch.distributed as dist

    counts = {"host_reads": 0, "collectives": 0, "cuda_syncs": 0}
    if not enabled:
        yield counts
        return
    patches = [(torch.Tensor, name, "host_reads") for name in HOST_READS]
    patches += [(dist, name, "collectives") for name in COLLECTIVES if hasattr(dist, name)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]

    def counted(original, key):
        def call(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        return call

    for (owner, name, key), (_, _, original) in zip(patches, originals):
        setattr(owner, name, counted(original, key))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        counts["cuda_syncs"] = sum("synchronizing" in str(w.message) for w in caught)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__")
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "barrier",
    "all_to_all", "send", "recv", "scatter",
)  # fmt: skip


# ---- the driver ----------------------------------------------------------------------------


def measure(impl, workload, device, iters, threads=1):
    args = [__file__, "--child", impl, workload, device, str(iters), "--threads", str(threads)]
    if WORKLOADS[workload][2] > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] + args
    else:
        cmd = [sys.executable] + args
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def benchmark(workload, device, repeats, lengths, threads):
    short, long = lengths
    impls = IMPLEMENTATIONS + (GRAPH_IMPLEMENTATIONS if device == "cuda" else ())
    runs = {impl: [] for impl in impls}
    for _ in range(repeats):
        for impl in impls:  # interleaved, so drifts in machine speed hit all alike
            a = measure(impl, workload, device, short, threads)
            b = measure(impl, workload, device, long, threads)
            rate = (long - short) / (b["seconds"] - a["seconds"])
            runs[impl].append(
                {"rate": rate, "startup": a["seconds"] - short / rate, "peak": b["peak_mem"]}
            )
    rows = []
    raw_rate = statistics.median(r["rate"] for r in runs["raw"])
    raw_peak = statistics.median(r["peak"] for r in runs["raw"])
    for impl in impls:
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


def count_per_iter(workload, device, iters, threads):
    """What the Trainer does per iteration, from runs of N and 2N iterations."""
    a = measure("count", workload, device, iters, threads)
    b = measure("count", workload, device, 2 * iters, threads)
    return {key: (b[key] - a[key]) / iters for key in ("host_reads", "collectives", "cuda_syncs")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=4, metavar=("IMPL", "WORKLOAD", "DEVICE", "ITERS"))
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads; 0: torch's")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--workloads", nargs="+", default=None, choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs=2, default=(2000, 6000))
    args = parser.parse_args()
    if args.child:
        impl, workload, device, iters = args.child
        return child(impl, workload, device, int(iters), args.threads)

    workloads = args.workloads or [
        name for name, (device, _, _) in WORKLOADS.items() if device in ("any", args.device)
    ]
    print(f"{time.strftime('%Y-%m-%d')}, device {args.device}, {args.repeats} repeats, "
          f"lengths {args.lengths[0]} and {args.lengths[1]} iterations, "
          f"{args.threads or 'default'} CPU threads")  # fmt: skip
    print("| workload | implementation | steps/s (median) | spread | ratio to raw | start-up s "
          "| peak memory ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for workload in workloads:
        for row in benchmark(workload, args.device, args.repeats, args.lengths, args.threads):
            peak = "-" if row["peak_ratio"] is None else f"{row['peak_ratio']:.3f}"
            print(
                f"| {workload} | {row['impl']} | {row['rate']:.0f} | {row['spread'][0]:.0f}-"
                f"{row['spread'][1]:.0f} | {row['ratio']:.3f} | {row['startup']:.2f} | {peak} |",
                flush=True,
            )

    print(
        "\nPer Trainer iteration (log every 50 iterations), from runs of 500 and 1000 iterations:"
    )
    print("| workload | host reads | Python collectives | CUDA syncs |")
    print("|---|---|---|---|")
    for workload in workloads:
        c = count_per_iter(workload, args.device, 500, args.threads)
        print(f"| {workload} | {c['host_reads']:.3f} | {c['collectives']:.3f} | "
              f"{c['cuda_syncs']:.3f} |", flush=True)  # fmt: skip
    print()
    save = [sys.executable, os.path.join(os.path.dirname(__file__), "checkpoint_save.py")]
    subprocess.run(save + ["--device", args.device], check=True)


if __name__ == "__main__":
    main()
