"""trainer/data.py: the RNG states a data pass starts from."""

import io
import random

import numpy as np
import torch

from trainer import set_random_seed
from trainer.data import get_rng_state, set_rng_state


def draw():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


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
