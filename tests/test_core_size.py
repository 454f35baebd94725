"""What a default run loads: the core, not the extras it does not use."""

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import cpu_env

pytestmark = pytest.mark.slow  # each test starts a fresh interpreter

DEFAULT_RUN = """
import json, sys, tempfile
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import Trainer

class Regressor(nn.Linear):
    def forward(self, batch):
        return nn.functional.mse_loss(super().forward(batch[0]), batch[1])

model = Regressor(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
Trainer(model, optimizer, None, data, max_epochs=1, work_dir=tempfile.mkdtemp()).train()
modules = {n: m.__file__ for n, m in sys.modules.items() if n.split(".")[0] == "trainer"}
print(json.dumps({n: sum(1 for _ in open(f)) for n, f in modules.items()}))
"""

# Features a default run does not use, which it must not import.
EXTRAS = [
    "trainer.checkpoint_errors",
    "trainer.checkpoint_load",
    "trainer.cuda_graph",
    "trainer.data_resume",
    "trainer.evaluation",
    "trainer.fsdp",
    "trainer.history_buffer",
    "trainer.log_rewind",
    "trainer.losses",
    "trainer.lr_warmup_auto",
    "trainer.metric_flush",
    "trainer.misc",
    "trainer.moved",
    "trainer.preemption_agreement",
    "trainer.process_group",
    "trainer.rank_agreement",
    "trainer.script_logging",
    "trainer.seed",
    "trainer.setup_errors",
    "trainer.sharded_checkpoint",
    "trainer.tensor_collectives",
    "trainer.unsized_stream",
    "trainer.hooks.best_checkpoint_hook",
    "trainer.hooks.early_stopping_hook",
    "trainer.hooks.ema_hook",
    "trainer.hooks.eval_hook",
    "trainer.hooks.metric_watch",
    "trainer.hooks.profiler_hook",
    "trainer.hooks.progress_bar_hook",
    "trainer.hooks.watchdog_hook",
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The lines of each ``trainer`` module a default single-process run has loaded when it
    ends, in a fresh interpreter."""
    script = tmp_path_factory.mktemp("run") / "default_run.py"
    script.write_text(textwrap.dedent(DEFAULT_RUN))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=cpu_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_default_run_imports_no_extra(loaded):
    assert "trainer.trainer" in loaded and "trainer.hooks.logger_hook" in loaded
    assert sorted(set(EXTRAS) & set(loaded)) == []


def test_the_extras_import_when_first_named():
    script = (
        "import sys, trainer, trainer.hooks as hooks\n"
        "assert 'trainer.hooks.ema_hook' not in sys.modules\n"
        "from trainer.hooks import EMAHook\n"
        "assert EMAHook.__module__ == 'trainer.hooks.ema_hook'\n"
        "assert trainer.EvalHook is hooks.EvalHook\n"
        "assert 'WatchdogHook' in dir(hooks)\n"
        "try:\n"
        "    hooks.NoSuchHook\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=cpu_env(), timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "module 'trainer.hooks' has no attribute 'NoSuchHook'"
