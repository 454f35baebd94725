"""What ``import trainer`` costs beside ``import torch``, in fresh interpreters.

    python benchmarks/import_time.py [--runs 11]

Each run starts a fresh interpreter that imports torch, then times ``import trainer`` alone
(torch's own import, which dominates, is left out). Reported: the median and the range of the
runs, in milliseconds, whether Python read compiled bytecode (an installed package has it;
``PYTHONDONTWRITEBYTECODE=1`` in a source checkout makes every run compile the modules, about
three times slower), and whether the import left torch.distributed.checkpoint out.
"""

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
import torch
start = time.perf_counter()
import trainer
seconds = time.perf_counter() - start
dcp = "torch.distributed.checkpoint" in sys.modules
print(json.dumps({"seconds": seconds, "dcp": dcp, "bytecode": not sys.dont_write_bytecode}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    results = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-3000:])
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ms = sorted(1000 * r["seconds"] for r in results)
    dcp = any(r["dcp"] for r in results)
    bytecode = "compiled bytecode" if results[-1]["bytecode"] else "no bytecode written"
    print(
        f"import trainer after import torch: median {statistics.median(ms):.0f} ms "
        f"({ms[0]:.0f}-{ms[-1]:.0f} ms, {len(ms)} fresh interpreters, {bytecode}); "
        f"torch.distributed.checkpoint {'imported' if dcp else 'not imported'}"
    )


if __name__ == "__main__":
    main()
