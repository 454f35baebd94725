"""Small helpers that the trainer, the hooks and scripts share: argument type checks, the model
without its wrappers, [`collect_env`][], [`set_random_seed`][] and the work_dir lock
(core-pytorch-utils' ``cpu.misc`` path)."""

import contextlib
import datetime
import logging
import os
import platform
import random
import socket
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import numpy as np
import torch
from tabulate import tabulate
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from .distributed import get_rank
from .logger import ensure_console_logging, open_fd_no_follow

__all__ = ["collect_env", "set_random_seed"]  # core-pytorch-utils' cpu.misc; the rest by name

try:
    import fcntl
except ImportError:  # Windows: no flock, no lock
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# Argument checks

NUMBER = (int, float)


def check_type(name: str, value: Any, types: Union[type, tuple[type, ...]], what: str) -> None:
    """Raise ``TypeError`` unless ``value`` is one of ``types`` (a bool is no int here)."""
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}.")


def check_int(name: str, value: Any, minimum: int, note: str = "") -> None:
    """Raise ``TypeError`` unless ``value`` is an int, ``ValueError`` if below ``minimum``."""
    what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    what += f" ({note})" if note else ""
    check_type(name, value, int, what)
    if value < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}.")


def check_file_name(name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is a str, ``ValueError`` unless it names a file
    inside the checkpoint folder (a sub-folder's too): never outside ``work_dir``."""
    check_type(name, value, str, "a file name in the checkpoint folder, e.g. 'iter_8.pth'")
    relative = os.path.normpath(value) if value else ""
    outside = relative in ("", ".", "..") or relative.startswith(".." + os.sep)
    if outside or os.path.isabs(value) or "\0" in value:
        raise ValueError(f"{name} must name a file inside the checkpoint folder, got {value!r}.")


# The model without its wrappers


def unwrapped(model: nn.Module) -> nn.Module:
    """``model`` without its torch.compile and DDP / DataParallel wrappers."""
    *_, module = wrappers(model)
    return module


def wrappers(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` and the modules torch.compile / DDP / DataParallel wrap, outermost first."""
    while True:
        yield model
        if _compiled(model):
            model = model._orig_mod
        elif isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        else:
            return


def plain_names(module: nn.Module, keys: Optional[Iterable[str]] = None) -> dict[str, str]:
    """Each of ``keys`` (the names of ``module``'s state: by default its ``state_dict()``'s) to
    its name in the uncompiled model: a submodule compiled on its own (``model.l1 =
    torch.compile(model.l1)``) holds ``l1._orig_mod.weight``, which is ``l1.weight`` there. Only
    the ``_orig_mod`` of a compiled module is dropped."""
    compiled = {name for name, m in module.named_modules(remove_duplicate=False) if _compiled(m)}
    names = {}
    for key in module.state_dict(keep_vars=True) if keys is None else keys:
        kept = []
        path = ""
        for part in key.split("."):
            if not (part == "_orig_mod" and path in compiled):
                kept.append(part)
            path = f"{path}.{part}" if path else part
        names[key] = ".".join(kept)
    return names


def plain_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` under the uncompiled model's names (see [`plain_names`][])."""
    state = module.state_dict()
    names = plain_names(module)
    if all(key == name for key, name in names.items()):
        return state
    return {names[key]: value for key, value in state.items()}


def _compiled(module: nn.Module) -> bool:
    # torch._dynamo is slow to import; a compiled model has imported it
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


# Reproducing a run


def collect_env() -> str:
    """The versions and devices that matter for reproducing a run, as a tabulate table."""
    rows = [
        ("sys.platform", sys.platform),
        ("Python", sys.version.replace("\n", " ")),
        ("machine", platform.machine()),
        ("numpy", np.__version__),
        ("PyTorch", f"{torch.__version__} @ {torch.__file__.rsplit('/', 2)[0]}"),
        ("PyTorch debug build", torch.version.debug),
        ("CUDA available", torch.cuda.is_available()),
    ]
    if torch.cuda.is_available():
        rows.append(("CUDA (torch built with)", torch.version.cuda))
        rows.append(("cuDNN", torch.backends.cudnn.version()))
        for i in range(torch.cuda.device_count()):
            rows.append((f"GPU {i}", torch.cuda.get_device_name(i)))
    rows.append(("CPU threads", torch.get_num_threads()))
    return tabulate(rows, tablefmt="simple")


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
        check_type("seed", seed, (int, np.integer), "an int or None")
        seed = int(seed)  # NumPy refuses one of 2**32 or more
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


# One live run per work_dir: a lock that rank 0 holds while train() runs

# The lock descriptors this process holds, which a forked child (a data loader's worker) closes:
# an flock belongs to the open file, so a worker outliving a failed run would keep it locked.
_HELD: set[int] = set()


def _close_in_child() -> None:
    while _HELD:
        os.close(_HELD.pop())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class WorkDirLock:
    """An ``flock`` on ``work_dir/.lock``, refusing a second run in the folder. The kernel
    releases it however the process ends (SIGKILL included), so a killed run blocks nothing."""

    def __init__(self, work_dir: str) -> None:
        self.path = os.path.join(work_dir, ".lock")
        #: Why the lock could not be taken (another run holds it), or None.
        self.problem: Optional[str] = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the block; [`problem`][] says if another run has it."""
        fd = self._acquire() if fcntl is not None else None
        try:
            yield
        finally:
            if fd is not None:
                _HELD.discard(fd)
                os.close(fd)  # releases the lock

    def _acquire(self) -> Optional[int]:
        self.problem = None
        # a link planted in work_dir must not make this write elsewhere
        fd = open_fd_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            self.problem = (
                f"{os.path.dirname(self.path)} is in use by another run ({holder}); wait for it "
                "to end, or pass another work_dir."
            )
            return None
        started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}".encode(), 0)
        _HELD.add(fd)
        return fd
