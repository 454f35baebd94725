"""The benchmark scripts run (tiny sizes) and report what they claim to; the timings themselves
are not asserted (that is what the benchmarks are for)."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def run(*args):
    cmd = [sys.executable, *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_overhead_counts_two_host_reads_per_log_period_and_no_collective():
    script = os.path.join(BENCHMARKS, "overhead.py")
    counts = [json.loads(run(script, "--child", "count", "mlp", "cpu", str(n))) for n in (100, 200)]
    # 2 log points more (log_period 50): one .tolist() at each; nothing in between
    assert counts[1]["host_reads"] - counts[0]["host_reads"] == 2
    assert counts[0]["collectives"] == counts[1]["collectives"] == 0
    timing = json.loads(run(script, "--child", "raw", "mlp", "cpu", "20"))
    assert timing["seconds"] > 0


def test_paired_overhead_and_checkpoint_save_report():
    paired = run(os.path.join(BENCHMARKS, "paired_overhead.py"), "--iters", "400")
    assert re.search(r"paired: median [\d.]+ \(quartiles [\d.]+-[\d.]+, 4 pairs", paired)
    flat = run(os.path.join(BENCHMARKS, "paired_overhead.py"), "--iters", "400", "--step", "flat")
    assert re.search(r"paired: median [\d.]+ \(quartiles [\d.]+-[\d.]+, 4 pairs", flat)
    save = run(os.path.join(BENCHMARKS, "checkpoint_save.py"), "--saves", "1")
    assert re.search(r"save_checkpoint blocks training \d+ ms", save)
    assert re.search(r"save_checkpoint is durable after \d+ ms", save)
    load = run(os.path.join(BENCHMARKS, "checkpoint_save.py"), "--load", "--state-gb", "0.01",
               "--loads", "1")  # fmt: skip
    ms = r"\d+ ms \(\d+-\d+\)"  # median (min-max)
    assert re.search(rf"a 0.01 GB checkpoint file: load_checkpoint {ms}, without its checksum "
                     rf"{ms}, torch.load {ms} \(median \(min-max\) of 1\)", load)  # fmt: skip


def test_paired_resnet_reports_the_ratio_of_its_pairs():
    # 4 epochs of 20 iterations: 2 to warm up, then 2 pairs
    out = run(os.path.join(BENCHMARKS, "paired_resnet.py"), "--iters", "80", "--batch-size", "2")
    ratio = r"median [\d.]+ \(quartiles [\d.]+-[\d.]+, 2 pairs of 20 iterations\)"
    assert re.search(rf"ResNet-18 class, CPU, bfloat16: .* steps/s, paired: {ratio}", out)


def test_checkpoint_save_fsdp_reports_both_modes_on_both_ranks():
    script = os.path.join(BENCHMARKS, "checkpoint_save.py")
    out = run(script, "--fsdp", "--state-gb", "0.01", "--saves", "1")  # launches 2 gloo ranks
    assert re.search(r"FSDP2 shards on 2 gloo ranks, with AdamW: 1\d MB of state", out)
    ms = r"\d+ ms \(\d+-\d+\)"  # median (min-max)
    for mode in ("full", "sharded"):
        for rank in (0, 1):  # each holds half of the state: about 5 MB
            assert re.search(rf"\| {mode} \| {rank} \| [56] MB \| {ms} \| {ms} \| \d+ MB \|", out)
        assert re.search(rf"{mode}: the checkpoint is complete after {ms}", out)


def test_iteration_profile_reports_the_extra_time_by_position():
    out = run(os.path.join(BENCHMARKS, "iteration_profile.py"), "--iters", "300")
    positions = ", ".join(f"{p}: [+-]\\d+" for p in (48, 49, 0, 1, 2))
    assert re.search(
        rf"ordinary iteration: \d+ us; extra time by position \(us\): {positions}; ", out
    )


def test_resume_cost_reports_the_samples_loaded_before_the_first_resumed_step():
    out = run(os.path.join(BENCHMARKS, "resume_cost.py"), "--repeats", "1", "--workers", "0")
    # skipped by index: the first step's batch of 4 alone, resumed and from scratch
    assert re.search(r"\| 0 \| [\d.]+ s \| 4 \| [\d.]+ s \| 4 \|", out)


def test_import_time_reports_the_cost_and_leaves_dcp_unimported():
    out = run(os.path.join(BENCHMARKS, "import_time.py"), "--runs", "1")
    assert re.search(r"import trainer after import torch: median \d+ ms \(\d+-\d+ ms, 1 fresh", out)
    assert out.rstrip().endswith("torch.distributed.checkpoint not imported")


def test_beside_cpu_job_reports_the_example_beside_a_busy_process():
    script = os.path.join(BENCHMARKS, "beside_cpu_job.py")
    out = run(script, "--runs", "1", "--epochs", "1", "--where", "beside")  # one run: ~4 s
    assert re.search(r"^default, beside 1 CPU-bound job\(s\): median [\d.]+ s \(", out, re.M)
