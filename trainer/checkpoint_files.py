"""Checkpoint files: atomic writes in the background, the ``latest.txt`` pointer, the listing
newest first, leftovers of interrupted writes, ``weights_only`` loads, and what a save refuses
(state that would not load, tensors that are not finite)."""

import collections
import glob
import logging
import os
import tempfile
import threading
from collections.abc import Collection, Iterator
from typing import Any, Callable, Optional

import numpy as np
import torch

from .fsdp import is_dtensor

logger = logging.getLogger(__name__)

LATEST_POINTER = "latest.txt"
_TEMP_SUFFIX = ".tmp"


def save_in_background(
    writer: "BackgroundWriter",
    copy: Callable[[], dict[str, Any]],
    path: str,
    then: Optional[Callable[[], None]] = None,
) -> None:
    """Write the state that ``copy()`` returns to ``path`` on ``writer``'s thread, then point
    ``latest.txt`` at it.

    Waits for the previous write first (and raises its error), so that one copy at a time is in
    memory; ``copy()`` must return a copy (:func:`copy_to_cpu`) that training cannot change,
    since training goes on once this returns.
    """
    writer.wait()  # one write at a time; raises if the previous one failed
    copied = copy()
    ckpt_dir, file_name = os.path.split(path)
    mode = 0o666 & ~current_umask()  # read here, in the training thread

    def write() -> None:
        atomic_save(copied, path, mode)
        update_latest_pointer(ckpt_dir, file_name, mode)
        logger.debug(f"Saved checkpoint {path}")  # the next log line names it
        if then is not None:
            then()

    writer.submit(write)


def atomic_save(obj: Any, path: str, mode: Optional[int] = None) -> None:
    """``torch.save`` that leaves ``path`` either untouched or complete, never half-written.

    The data goes to a temporary file in the same folder, is flushed to disk, and replaces
    ``path`` in one ``os.replace``; the folder is then synced so the rename itself is durable.
    The file gets permissions ``mode`` (by default what ``open()`` would give: 0o666 less the
    umask), not the 0o600 of a temporary file.
    """
    _atomic_write(path, lambda f: torch.save(obj, f), mode)


def update_latest_pointer(ckpt_dir: str, file_name: str, mode: Optional[int] = None) -> None:
    """Point ``ckpt_dir/latest.txt`` at ``file_name``, atomically (works where symlinks do not)."""
    path = os.path.join(ckpt_dir, LATEST_POINTER)
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)  # damage in its place (an empty folder); a full one raises, named
    _atomic_write(path, lambda f: f.write(file_name.encode()), mode)


def current_umask() -> int:
    """The process's umask (Linux reports it; elsewhere it is set and restored at once)."""
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


def read_latest_pointer(ckpt_dir: str) -> Optional[str]:
    """The path ``latest.txt`` names, or None when there is no pointer yet or it is damaged
    (then with a warning: the checkpoints are searched by age instead)."""
    pointer = os.path.join(ckpt_dir, LATEST_POINTER)
    if not os.path.lexists(pointer):
        return None
    try:
        with open(pointer, "rb") as f:
            name = f.read().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = (
            "a directory, not a file" if os.path.isdir(pointer)
            else "not UTF-8 text" if isinstance(e, UnicodeDecodeError)
            else e.strerror or str(e)
        )  # fmt: skip
        logger.warning(f"{pointer} is damaged ({reason}); using the newest checkpoint by age.")
        return None
    return os.path.join(ckpt_dir, name) if name else None


def list_checkpoints(ckpt_dir: str) -> list[str]:
    """The ``.pth`` entries in ``ckpt_dir``, newest first: the one ``latest.txt`` names leads.
    (Entries that are not files, such as a dangling link, stay in the list: loading them fails
    with a reason that is worth a warning.)"""
    paths = sorted(glob.glob(os.path.join(ckpt_dir, "*.pth")), key=lambda p: (_mtime(p), p))[::-1]
    latest = read_latest_pointer(ckpt_dir)
    if latest in paths:
        paths.remove(latest)
        paths.insert(0, latest)
    return paths


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # a dangling link
        return 0.0


def remove_temp_files(ckpt_dir: str) -> list[str]:
    """Delete the temporary files that writes interrupted by a crash left behind."""
    stray = glob.glob(os.path.join(ckpt_dir, f".*{_TEMP_SUFFIX}"))
    for path in stray:
        os.remove(path)
    return stray


# What ``torch.load(weights_only=True)`` rebuilds as it was saved, besides tensors and the
# containers below: values of exactly these types (a subclass, such as an enum, does not load).
_ATOMS = frozenset({str, bytes, int, float, complex, bool, type(None), torch.dtype,
                    torch.device, torch.Size})  # fmt: skip
# Mappings that load as themselves. Any other one (a defaultdict, say) is refused: copied to a
# dict it would come back without its behaviour.
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)
# Tensors that load as what they are: a Parameter is saved as the plain tensor it holds, and a
# sharded model's DTensors load too; another subclass's type would not load.
_TENSORS = (torch.Tensor, torch.nn.Parameter)
# NumPy scalars that become Python numbers computing the same (np.float64 is a Python float).
_NUMPY_AS_PYTHON = (np.bool_, np.integer, np.float64)


class UnloadableState(TypeError):
    """A value in a checkpoint's state that ``torch.load(weights_only=True)`` cannot rebuild.

    Args:
        path: The keys and indices that lead to the value, from the top of the state.
        value: The value.
    """

    def __init__(self, path: tuple, value: Any) -> None:
        self.path, self.value = path, value
        super().__init__(f"{describe(value)} at {format_path(path)}")


def describe(value: Any) -> str:
    """``value``'s type for a message: ``a defaultdict``, ``a numpy.float32``."""
    kind = type(value)
    module = "" if kind.__module__ == "builtins" else kind.__module__.split(".")[0] + "."
    return f"a {module}{kind.__qualname__}"


def format_path(path: tuple) -> str:
    """Keys and indices as Python reads them: ``['lr_lambdas'][0]['table']``."""
    return "".join(f"[{key!r}]" for key in path) or "the top"


def copy_to_cpu(state: Any) -> Any:
    """A copy of ``state`` that training cannot change under it, as plain data that
    ``torch.load(weights_only=True)`` rebuilds as it was.

    Tensors are copied to CPU memory (CUDA ones through pinned memory, with one sync for all).
    Containers are rebuilt by what they hold, never by ``type(obj)(items)``: dicts, lists,
    tuples, sets and the mappings that load as themselves (``OrderedDict``, ``Counter``).
    NumPy bools, ints and float64s become the Python numbers they equal. Anything else raises
    :class:`UnloadableState`, naming where it is.
    """
    copied_from_cuda: list[torch.device] = []

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor.detach().clone()
        copied_from_cuda.append(tensor.device)
        return tensor.detach().to("cpu", non_blocking=True)  # lands in pinned memory

    result = _plain(state, (), copy_tensor)
    for device in set(copied_from_cuda):
        torch.cuda.current_stream(device).synchronize()  # the copies are done when this returns
    return result


def check_plain(state: Any) -> None:
    """Raise :class:`UnloadableState` where ``state`` holds a value that :func:`copy_to_cpu`
    would refuse; copies nothing."""
    _plain(state, (), lambda tensor: tensor)


def _plain(obj: Any, path: tuple, tensor: Callable[[torch.Tensor], Any]) -> Any:
    kind = type(obj)
    if kind in _ATOMS:
        return obj
    if kind in _TENSORS or (isinstance(obj, torch.Tensor) and is_dtensor(obj)):
        return tensor(obj)
    if kind in _MAPPINGS:
        items = {}
        for key, value in obj.items():
            items[_plain(key, (*path, key), tensor)] = _plain(value, (*path, key), tensor)
        return items if kind is dict else kind(items)  # an OrderedDict or a Counter of them
    if kind is list or kind is tuple:
        return kind([_plain(value, (*path, i), tensor) for i, value in enumerate(obj)])
    if kind is set:
        return {_plain(value, (*path, "{...}"), tensor) for value in obj}
    if isinstance(obj, _NUMPY_AS_PYTHON):
        return obj.item()
    raise UnloadableState(path, obj)


class BackgroundWriter:
    """Runs checkpoint writes on a background thread, one at a time.

    :meth:`submit` waits for the previous write first; :meth:`wait` waits for the current one.
    Both raise the exception a write ended with, so a failure surfaces at the next save or at the
    end of training. The thread is not a daemon: an interpreter that exits finishes the write.

    Example::

        >>> import tempfile, os
        >>> writer = BackgroundWriter()
        >>> path = os.path.join(tempfile.mkdtemp(), "state.pth")
        >>> writer.submit(lambda: atomic_save({"step": 1}, path))
        >>> writer.wait()
        >>> torch.load(path, weights_only=True)
        {'step': 1}
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        #: The last write failed and :meth:`wait` has not raised it yet (read it freely: a flag).
        self.failed = False

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


def load_checkpoint_file(path: str) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``: tensors and plain data only, never code."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"Checkpoint {path!r} is a directory, not a file.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint {path!r} does not exist.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(
            f"Checkpoint {path!r} could not be loaded safely (weights_only=True): {e}"
        ) from e
    if not isinstance(data, dict):
        raise RuntimeError(f"Checkpoint {path!r} holds a {type(data).__name__}, expected a dict.")
    return data


def atomic_write(path: str, write: Callable[[Any], Any], mode: Optional[int] = None) -> None:
    """Write ``path`` through ``write(binary file)`` so that it is either untouched or complete:
    a fresh temporary file in its folder (never one planted there), flushed to disk, then one
    ``os.replace`` and a sync of the folder. The file gets permissions ``mode``, by default what
    ``open()`` would give (0o666 less the umask), not a temporary file's 0o600. A failed write
    removes the temporary file and raises."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.", suffix=_TEMP_SUFFIX, dir=folder
        )
        os.fchmod(fd, 0o666 & ~current_umask() if mode is None else mode)  # mkstemp: 0o600
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # makes the rename itself durable
        finally:
            os.close(dir_fd)
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        raise


def _atomic_write(path: str, write: Callable[[Any], Any], mode: Optional[int]) -> None:
    """:func:`atomic_write` for a checkpoint file, whose failure says what is kept."""
    try:
        atomic_write(path, write, mode)
    except BaseException as e:
        # torch.save reports a failed write (a full disk) as a RuntimeError of its own, with
        # the OSError as its context
        cause = next((c for c in _chain(e) if isinstance(c, OSError)), None)
        if cause is not None:
            message = (
                f"Could not write {path}: {cause.strerror or cause}. The previous checkpoint "
                "and latest.txt are untouched; free disk space or pick another work_dir."
            )
            # OSError(None, message) would read "[Errno None] ..."
            raise (OSError(cause.errno, message) if cause.errno else OSError(message)) from e
        raise


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def non_finite(state: Any, prefix: str = "", inf_ok: Collection[str] = ()) -> list[str]:
    """The names (``model.linear.weight``, ``optimizer.0.momentum_buffer``, ...) of the
    floating-point tensors in the nested dicts and lists of ``state`` that hold a NaN or an
    infinity (only a NaN for the names in ``inf_ok``); sharded tensors are checked in this
    rank's shard. One host read per device."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in _named_tensors(state, prefix):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor
        if local.is_floating_point() or local.is_complex():
            by_device.setdefault(local.device, []).append((name, local))
    bad = []
    for items in by_device.values():
        fine = [
            torch.isnan(t).any().logical_not() if name in inf_ok else torch.isfinite(t).all()
            for name, t in items
        ]
        bad += [name for (name, _), ok in zip(items, torch.stack(fine).tolist()) if not ok]
    return bad


def _named_tensors(state: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _named_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def bad_tensors(data: dict[str, Any], parameters: Collection[str]) -> list[str]:
    """The tensors of a checkpoint's ``data`` that no run should go on from: the model's
    ``parameters``, the optimizer's state and the registered objects' must be finite, the
    model's buffers free of NaN (an infinity may be on purpose, as a causal mask's -inf is)."""
    state = {key: data[key] for key in ("model", "optimizer", "extra") if key in data}
    buffers = {f"model.{key}" for key in state.get("model", {}) if key not in parameters}
    return non_finite(state, inf_ok=buffers)
