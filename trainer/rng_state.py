"""The state of every random number generator that training depends on, as checkpoint data."""

import random
from typing import Any

import numpy as np
import torch


def get_rng_state(extra_generators: tuple[torch.Generator, ...] = ()) -> dict[str, Any]:
    """The state of every RNG that training depends on, as plain data and tensors (loadable with
    ``weights_only=True``); :func:`set_rng_state` restores it."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": [g.get_state() for g in extra_generators],
    }


def set_rng_state(
    state: dict[str, Any], extra_generators: tuple[torch.Generator, ...] = ()
) -> None:
    """Restore what :func:`get_rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for g, g_state in zip(extra_generators, state["generators"]):
        g.set_state(g_state)
