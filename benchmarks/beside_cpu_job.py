"""README's example, alone and beside CPU-bound jobs, in fresh processes.

    python benchmarks/beside_cpu_job.py [--runs 3] [--env - OMP_NUM_THREADS=2 ...] [--jobs 1]

Times ``python examples/train_digits.py`` (a fresh work dir each run, so that every run trains
its 15 epochs, or ``--epochs``) alone and beside ``--jobs`` processes running ``while True:
pass``, which keep cores busy for as long as the example runs (``--where idle beside``: both,
the default). ``--env`` adds variables to the example's environment (one set per value,
``A=1,B=2`` for two, ``-`` for none). The sets' runs alternate, so that a change in the
machine's load shows in every set. Reported: each run's seconds, the load average before the
runs (other jobs on a shared machine move the figures), and each set's median and range."""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")


def time_example(env: dict, jobs: int, epochs: int) -> float:
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(jobs)]
    try:
        with tempfile.TemporaryDirectory() as work_dir:
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, EXAMPLE, "--work-dir", work_dir, "--epochs", str(epochs)],
                env=env, check=True, capture_output=True, timeout=600,
            )  # fmt: skip
            return time.perf_counter() - start
    finally:
        for job in busy:
            job.kill()
            job.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--env", nargs="+", default=["-"], help="e.g. OMP_NUM_THREADS=2, or -")
    parser.add_argument("--where", nargs="+", default=["idle", "beside"], help="idle, beside")
    parser.add_argument("--jobs", type=int, default=1, help="CPU-bound jobs beside it")
    parser.add_argument("--epochs", type=int, default=15, help="the example's (15: README's)")
    args = parser.parse_args()
    sets = [(extra, where) for extra in args.env for where in args.where]
    seconds: dict = {s: [] for s in sets}
    loads = []
    for _ in range(args.runs):
        for extra, where in sets:
            loads.append(os.getloadavg()[0])
            env = dict(os.environ)
            env.update(dict(v.split("=", 1) for v in extra.split(",")) if extra != "-" else {})
            seconds[extra, where].append(
                time_example(env, args.jobs if where == "beside" else 0, args.epochs)
            )
            print(f"{extra}, {where}: {seconds[extra, where][-1]:.1f} s", flush=True)
    print(f"load average before the runs: {min(loads):.2f}-{max(loads):.2f}")
    for (extra, where), times in seconds.items():
        times.sort()
        print(
            f"{extra if extra != '-' else 'default'}, "
            f"{f'beside {args.jobs} CPU-bound job(s)' if where == 'beside' else 'idle'}: median "
            f"{statistics.median(times):.1f} s ({times[0]:.1f}-{times[-1]:.1f} s, "
            f"{len(times)} runs)"
        )


if __name__ == "__main__":
    main()
