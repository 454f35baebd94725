import io
import logging
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from trainer import set_random_seed
from trainer.rng_state import get_rng_state, set_rng_state


def draw():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_set_random_seed_makes_runs_repeat():
    assert set_random_seed(7) == 7
    first = draw()
    set_random_seed(7)
    assert draw() == first
    assert isinstance(set_random_seed(None), int)


@pytest.mark.parametrize("seed", [None, -1, -5])
def test_no_seed_or_a_negative_one_picks_a_random_seed_logs_and_returns_it(seed, caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    used = set_random_seed(seed)
    assert 0 <= used < 2**31 and torch.initial_seed() == used
    assert f"Using a random seed: {used}" in caplog.text
    first = draw()
    set_random_seed(used)  # the logged seed repeats the run
    assert draw() == first


def test_rng_state_round_trips_through_weights_only_load():
    gen = torch.Generator().manual_seed(5)
    set_random_seed(1)
    buffer = io.BytesIO()
    torch.save(get_rng_state((gen,)), buffer)
    expected = draw() + (float(torch.rand((), generator=gen)),)
    draw()
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True), (gen,))
    assert draw() + (float(torch.rand((), generator=gen)),) == expected


@pytest.mark.slow
def test_a_picked_seed_is_shown_before_logging_is_set_up_and_run_json_keeps_it(tmp_path):
    script = (
        "import torch\n"
        "from trainer import Trainer, set_random_seed\n"
        "seed = set_random_seed(-1)\n"
        "model = torch.nn.Linear(2, 1)\n"
        "trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None,\n"
        f"                  [torch.zeros(2)], max_epochs=1, work_dir={str(tmp_path)!r})\n"
        "print(seed, trainer.run_config['seed'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seed, recorded = proc.stdout.split()
    assert seed == recorded and f"Using a random seed: {seed}" in proc.stderr


@pytest.mark.parametrize(
    "seed, error, message",
    [("1", TypeError, "an int or None, got str '1'"), (1.5, TypeError, "got float 1.5"),
     (True, TypeError, "got bool True"), (2**32, ValueError, "below 2**32")],
)  # fmt: skip
def test_a_seed_of_another_type_or_too_large_is_refused(seed, error, message):
    with pytest.raises(error, match=re.escape(message)):
        set_random_seed(seed)
    assert set_random_seed(np.int64(7)) == 7
