"""The state of every random number generator that training depends on, as checkpoint data:
:func:`get_rng_state` (in ``progress.py``, which every run loads) and :func:`set_rng_state`,
which only a resume needs."""

import random
from typing import Any

import numpy as np
import torch

from .progress import get_rng_state

__all__ = ["get_rng_state", "set_rng_state"]


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
