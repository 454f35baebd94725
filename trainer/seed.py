"""Seeding and capturing every random number generator that training depends on."""

import logging
import os
import random
from typing import Any, Optional

import numpy as np
import torch

from .distributed import get_rank
from .logger import ensure_console_logging

logger = logging.getLogger(__name__)


def set_random_seed(seed: Optional[int] = None, deterministic: bool = False) -> int:
    """Seed Python, NumPy and torch (CPU and every CUDA device).

    Args:
        seed: The seed; None or a negative one (core-pytorch-utils' -1) draws one from the OS
            and logs it, so that the run can be repeated. It is returned.
        deterministic: Also make cuDNN and torch pick deterministic algorithms (slower).

    Example::

        >>> set_random_seed(0)
        0
    """
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}.")
        seed = int(seed)
        if seed >= 2**32:
            raise ValueError(
                f"seed must be below 2**32 (NumPy's limit), got {seed}; pass None or a negative "
                "seed to have one picked."
            )
    if seed is None or seed < 0:
        # under torchrun each rank picks its own; rank 0 shows it, even before logging is set up
        seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        ensure_console_logging("trainer", get_rank())
        logger.info(f"Using a random seed: {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    return seed


def get_rng_state(extra_generators: tuple[torch.Generator, ...] = ()) -> dict[str, Any]:
    """The state of every RNG as plain data and tensors (loadable with ``weights_only=True``)."""
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
