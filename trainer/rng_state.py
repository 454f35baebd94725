"""The state of every random number generator that training depends on, as checkpoint data.
``set_rng_state``, which only a resume needs, lives in ``data_resume.py``."""

import random
from typing import Any

import numpy as np
import torch


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


def __getattr__(name: str) -> Any:
    if name == "set_rng_state":
        from .data_resume import set_rng_state

        return set_rng_state
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
