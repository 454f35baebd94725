"""Checkpoint files: atomic writes in the background, the ``latest.txt`` pointer, and what a save
refuses (state that ``torch.load(weights_only=True)`` cannot rebuild, tensors not finite)."""

import collections
import os
import shutil
import tempfile
import threading
from collections.abc import Collection, Iterator
from typing import Any, Callable, Optional

import numpy as np
import torch

from .distributed import is_dtensor

LATEST_POINTER = "latest.txt"
TEMP_SUFFIX = ".tmp"
ASIDE_SUFFIX = ".old"  # after TEMP_SUFFIX: a checkpoint moved aside (aside())


class BackgroundWriter:
    """Runs checkpoint writes on a thread, one at a time; :meth:`submit` and :meth:`wait` raise
    what the previous write raised. Not a daemon: an exiting interpreter finishes the write."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.failed = False  # a write failed and wait() has not raised it (read every iteration)

    def submit(self, write: Callable[[], None]) -> None:
        """Wait for the previous write, then start ``write()`` in the background."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer")
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error, self.failed = self._error, None, False
            raise error

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # handed to the training thread at its next wait()
            self._error, self.failed = e, True


def atomic_save(obj: Any, path: str, mode: Optional[int] = None) -> None:
    """``torch.save`` that leaves ``path`` untouched or complete (see :func:`atomic_write`)."""
    _atomic_write(path, lambda f: torch.save(obj, f), mode)


def update_latest_pointer(ckpt_dir: str, file_name: str, mode: Optional[int] = None) -> None:
    """Point ``ckpt_dir/latest.txt`` at ``file_name``, atomically (works where symlinks do not)."""
    path = os.path.join(ckpt_dir, LATEST_POINTER)
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)  # damage in its place (an empty folder); a full one raises, named
    _atomic_write(path, lambda f: f.write(file_name.encode()), mode)


def fsync_folder(folder: str) -> None:
    """Make the renames in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def aside(path: str) -> str:
    """Where a checkpoint at ``path`` waits while a new one of its name replaces it: put back
    at the next start if a crash comes first (``sharded_checkpoint.remove_stray``)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TEMP_SUFFIX}{ASIDE_SUFFIX}")


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint file, a link, or a sharded checkpoint's folder (never what a link
    points to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def current_umask() -> int:
    """The process's umask, read from Linux's /proc (setting and restoring it races threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[Any], Any], mode: Optional[int] = None) -> None:
    """Write ``path`` through ``write(binary file)`` so that it is either untouched or complete:
    a temporary file in its folder, fsynced, ``os.replace``-d, then the folder fsynced. The file
    gets permissions ``mode``, by default 0o666 less the umask (not mkstemp's 0o600)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        prefix = f".{os.path.basename(path)}."
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=TEMP_SUFFIX, dir=folder)
        os.fchmod(fd, 0o666 & ~current_umask() if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_folder(folder)  # makes the rename itself durable
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        raise


def _atomic_write(path: str, write: Callable[[Any], Any], mode: Optional[int]) -> None:
    """:func:`atomic_write` for a checkpoint file, whose failure says what is kept."""
    try:
        atomic_write(path, write, mode)
    except BaseException as e:
        try:
            from .checkpoint_errors import raise_write_failure
        except (ImportError, OSError):  # no file descriptor left to import with, say
            raise e from None  # the error as it is
        raise_write_failure(path, e)


# What ``torch.load(weights_only=True)`` rebuilds as it was saved: tensors, the containers that
# _plain copies, and values of exactly these types (a subclass, such as an enum, does not load).
_ATOMS = frozenset({str, bytes, int, float, complex, bool, type(None), torch.dtype,
                    torch.device, torch.Size})  # fmt: skip
# Any other mapping (a defaultdict, say) is refused: as a dict it would lose its behaviour.
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)
# A Parameter is saved as the plain tensor it holds; another subclass's type would not load.
_TENSORS = (torch.Tensor, torch.nn.Parameter)
# NumPy scalars that become Python numbers computing the same (np.float64 is a Python float).
_NUMPY_AS_PYTHON = (np.bool_, np.integer, np.float64)


class UnloadableState(TypeError):
    """A ``value`` at ``path`` (keys and indices) of a checkpoint's state that
    ``torch.load(weights_only=True)`` cannot rebuild."""

    def __init__(self, path: tuple, value: Any) -> None:
        super().__init__(f"{type(value).__name__} at {list(path)}")
        self.path, self.value = path, value


def copy_to_cpu(state: Any) -> Any:
    """A copy of ``state`` that training cannot change, as plain data (see :func:`_plain`);
    CUDA tensors are copied through pinned memory, with one sync for all."""
    copied_from_cuda: set[torch.device] = set()

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor.detach().clone()
        copied_from_cuda.add(tensor.device)
        return tensor.detach().to("cpu", non_blocking=True)  # lands in pinned memory

    result = _plain(state, (), copy_tensor)
    for device in copied_from_cuda:
        torch.cuda.current_stream(device).synchronize()  # the copies are done when this returns
    return result


def check_plain(state: Any) -> None:
    """Raise :class:`UnloadableState` where :func:`copy_to_cpu` would; copies nothing."""
    _plain(state, (), lambda tensor: tensor)


def _plain(obj: Any, path: tuple, tensor: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` rebuilt by what it holds, never by ``type(obj)(items)``, with ``tensor()`` of each
    tensor; NumPy bools, ints and float64s as Python numbers; anything else raises."""
    kind = type(obj)
    if kind in _ATOMS:
        return obj
    if kind in _TENSORS or (isinstance(obj, torch.Tensor) and is_dtensor(obj)):
        return tensor(obj)
    if kind in _MAPPINGS:
        items = {}
        for key, value in obj.items():
            items[_plain(key, (*path, key), tensor)] = _plain(value, (*path, key), tensor)
        return items if kind is dict else kind(items)
    if kind is list or kind is tuple:
        return kind([_plain(value, (*path, i), tensor) for i, value in enumerate(obj)])
    if kind is set:
        return {_plain(value, (*path, "{...}"), tensor) for value in obj}
    if isinstance(obj, _NUMPY_AS_PYTHON):
        return obj.item()
    raise UnloadableState(path, obj)


def bad_tensors(data: dict[str, Any], parameters: Collection[str]) -> list[str]:
    """The names (``model.linear.weight``, ``optimizer.0.momentum_buffer``...) of the tensors in
    ``data`` no run should go on from: parameters, optimizer and registered state not finite, or
    a model buffer holding a NaN (a causal mask's -inf is on purpose). One host read per device."""
    state = {key: data[key] for key in ("model", "optimizer", "extra") if key in data}
    buffers = {f"model.{key}" for key in state.get("model", {}) if key not in parameters}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in _named_tensors(state, ""):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
        if local.is_floating_point() or local.is_complex():
            by_device.setdefault(local.device, []).append((name, local))
    bad = []
    for items in by_device.values():
        fine = [
            torch.isnan(t).any().logical_not() if name in buffers else torch.isfinite(t).all()
            for name, t in items
        ]
        bad += [name for (name, _), ok in zip(items, torch.stack(fine).tolist()) if not ok]
    return bad


def _named_tensors(state: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for key, value in items:
            yield from _named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
