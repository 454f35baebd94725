"""Checkpoint bytes on disk: writes in the background, atomic writes, ``weights_only`` reads,
what a save refuses (state that ``torch.load(weights_only=True)`` cannot rebuild, tensors not
finite) and putting loaded weights into a model (matching keys and shapes, ``revise_keys``).
What a checkpoint holds and how its files are named is ``checkpoint.py``'s; the temporary file
of an atomic write ends in :data:`TEMP_SUFFIX`, which a start looks for."""

import collections
import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
from collections.abc import Collection, Iterator
from typing import Any, Callable, NoReturn, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from . import checksum
from .distributed import all_gather, get_world_size, is_dtensor
from .fsdp import keyed_by_name, load_full_model_state, load_full_optimizer_state
from .misc import plain_names

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"  # the end of a file being written (atomic_write's temporary file)


# Writing


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
            # Short waits, not one join(): CPython's lock wait is not woken by a signal that came
            # just before it blocked, or that another thread took, so a Ctrl-C's handler would
            # run only when the write ends, however long it takes.
            while self._thread.is_alive():
                self._thread.join(timeout=0.1)
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
    """``torch.save`` that leaves ``path`` untouched or complete (see :func:`atomic_write`),
    ending with the checksum of its bytes (:func:`checksum.save`); a failure says that the
    previous checkpoint is kept."""
    write_checkpoint_file(path, lambda f: checksum.save(obj, f), mode)


def write_checkpoint_file(path: str, write: Callable[[Any], Any], mode: Optional[int]) -> None:
    """:func:`atomic_write` of a checkpoint's file, whose failure says what is kept."""
    try:
        atomic_write(path, write, mode)
    except BaseException as e:
        raise_write_failure(path, e)


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


def fsync_folder(folder: str) -> None:
    """Make the renames in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def raise_write_failure(path: str, error: BaseException) -> NoReturn:
    """Raise the error of a failed write of ``path``, saying what is kept, if an ``OSError`` is
    behind ``error`` (torch.save reports a full disk as a RuntimeError of its own, with the
    OSError as its context); else ``error`` itself."""
    cause = next((c for c in _chain(error) if isinstance(c, OSError)), None)
    if cause is None:
        raise error
    message = (
        f"Could not write {path}: {cause.strerror or cause}. The previous checkpoint "
        "and latest.txt are untouched; free disk space or pick another work_dir."
    )
    # OSError(None, message) would read "[Errno None] ..."
    raise (OSError(cause.errno, message) if cause.errno else OSError(message)) from error


def _chain(error: Optional[BaseException]) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


# What a save refuses


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
    a model buffer holding a NaN (a causal mask's -inf is on purpose). One host read per device,
    and one more where a sum is not finite."""
    state = {key: data[key] for key in ("model", "optimizer", "extra") if key in data}
    buffers = {f"model.{key}" for key in state.get("model", {}) if key not in parameters}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors(state, ""):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
        if local.is_floating_point() or local.is_complex():
            by_device.setdefault(local.device, []).append((name, local))
    bad = []
    for items in by_device.values():
        # A finite sum holds no NaN or infinity (they carry into it): one pass, no mask. Only a
        # sum that is not (an overflow, a causal mask's -inf) is checked element by element.
        summed = torch.stack([torch.isfinite(t.sum()) for _, t in items]).tolist()
        items = [item for item, ok in zip(items, summed) if not ok]
        fine = [
            torch.isnan(t).any().logical_not() if name in buffers else torch.isfinite(t).all()
            for name, t in items
        ]
        if fine:
            bad += [name for (name, _), ok in zip(items, torch.stack(fine).tolist()) if not ok]
    return bad


def named_tensors(state: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for key, value in items:
            yield from named_tensors(value, f"{prefix}.{key}" if prefix else str(key))


def check_rank_state(state: dict[str, Any], group: Any, check_buffers: bool) -> bool:
    """Of an FSDP2 model's checkpoint (either kind), what one copy keeps for every rank must
    be the same on every rank. DTensors in the state of the hooks and registered objects (an
    EMAHook's average, say), which rank 0 writes alone, are refused: every rank would resume
    with rank 0's shard. Model buffers that differ by rank (BatchNorm's running statistics
    without SyncBatchNorm) are named in a warning, if ``check_buffers`` (a collective over
    ``group``): one copy of each is kept. Returns whether it warned."""
    rest = {key: value for key, value in state.items() if key not in ("model", "optimizer")}
    named = named_tensors(rest, "")
    parts = sorted({".".join(name.split(".")[:2]) for name, t in named if is_dtensor(t)})
    if parts:
        raise ValueError(
            f"{', '.join(parts)} holds DTensors (shards of the FSDP2 model), which a checkpoint "
            "cannot keep: rank 0 writes the state of the hooks and registered objects, and the "
            "ranks' shards differ. Keep plain tensors there (a DTensor's full_tensor())."
        )
    if get_world_size() == 1 or not check_buffers:
        return False
    buffers = {
        name: t for name, t in state["model"].items()
        if isinstance(t, torch.Tensor) and not is_dtensor(t) and t.is_floating_point()
    }  # fmt: skip
    sums = torch.stack([t.double().sum() for t in buffers.values()]).tolist() if buffers else []
    everyone = all_gather(sums, group=group)
    differ = [name for i, name in enumerate(buffers) if len({s[i] for s in everyone}) > 1]
    if differ:
        logger.warning(
            f"The model's buffers {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''} "
            "differ by rank (FSDP2 does not synchronize buffers), and a checkpoint keeps one "
            "copy of each: a resumed run gives it to every rank, so it does not go on exactly "
            "as this one would. Use SyncBatchNorm to keep them equal."
        )
    return bool(differ)


# Reading


def load_checkpoint_file(
    path: str, need_checksum: bool = True, check: Optional[Callable[[dict], None]] = None
) -> dict[str, Any]:
    """Load a checkpoint file with ``weights_only=True`` (tensors and plain data only, never
    code), checking its checksum on a thread meanwhile (:func:`checksum.check_file`): a damaged
    file, or one without a checksum unless not ``need_checksum`` (weights from elsewhere), is
    refused. ``check(data)`` runs while the checksum is checked; what it raises is raised unless
    the file is damaged (then the damage is the reason)."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"Checkpoint {path!r} is a directory, not a file.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint {path!r} does not exist.")
    checked = checksum.in_background(lambda: checksum.check_file(path, need_checksum))
    error: Optional[Exception] = None
    try:
        data = _read(path)
        if check is not None:
            check(data)
    except Exception as e:
        error = e
    checked()  # first: damage says more than what torch.load or the checks made of it
    if error is not None:
        raise error
    return data


def _read(path: str) -> dict[str, Any]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        _raise_read_failure(path, e)
    if not isinstance(data, dict):
        raise RuntimeError(f"Checkpoint {path!r} holds a {type(data).__name__}, expected a dict.")
    return data


def _raise_read_failure(path: str, error: Exception) -> NoReturn:
    """Raise a RuntimeError naming ``path`` for what ``torch.load(weights_only=True)`` refused:
    a pickle of code, of another object (a class of the user's: torch's message names it and how
    to allow it), or a file that is no checkpoint or a damaged one. For code and for such files,
    never torch's advice to load them with ``weights_only=False``, not even in the cause."""
    text = str(error)
    blocked = re.search(r"GLOBAL (\S+) whose module \S+ is blocked", text)
    if isinstance(error, pickle.UnpicklingError) and blocked:
        raise RuntimeError(
            f"Checkpoint {path!r} could not be loaded safely (weights_only=True): it would call "
            f"{blocked[1]}, code that no checkpoint holds. Do not load this file."
        ) from None
    if isinstance(error, pickle.UnpicklingError) and "GLOBAL " in text:
        raise RuntimeError(
            f"Checkpoint {path!r} could not be loaded safely (weights_only=True): {error}"
        ) from error
    advice = "weights_only" in text  # torch's, to load it with weights_only=False
    sentence = "" if advice else text.split(". ")[0]
    raise RuntimeError(
        f"Checkpoint {path!r} is not a checkpoint torch can read, or is damaged (cut short or "
        f"overwritten): torch.load failed with {type(error).__name__}"
        f"{f': {sentence}' if sentence else ''}. Pass a file that torch.save wrote, whole (copy "
        "it again if it was cut short)."
    ) from (None if advice else error)


def check_finite(data: dict[str, Any], path: str, parameters: Collection[str]) -> None:
    """Raise a RuntimeError naming ``path`` when its tensors hold values no run should go on
    from (see :func:`bad_tensors`): a checkpoint written before saves refused them, or weights
    from elsewhere."""
    refuse_non_finite(bad_tensors(data, parameters), path, weights_only="optimizer" not in data)


def refuse_non_finite(bad: list[str], path: str, weights_only: bool) -> None:
    """Raise a RuntimeError naming ``path`` if ``bad`` names tensors that hold NaN or infinite
    values (of weights alone, or of a whole training state)."""
    if bad:
        what = "resuming it would fail at once. Resume from an older checkpoint."
        if weights_only:
            what = "training or evaluating from them would give NaN. Load other weights."
        raise RuntimeError(
            f"Checkpoint {path!r} holds NaN or infinite values in {len(bad)} tensors "
            f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}): {what}"
        )


def load_model_state(
    module: nn.Module, state: dict[str, Any], path: str, strict: bool, sharded: bool
) -> None:
    """Load checkpointed weights into ``module`` (the unwrapped model), listing the keys and
    shapes that differ; ``strict=False`` loads those that match. Keys match by the names of the
    uncompiled model, whichever of its modules torch.compile wrapped when saved or now."""
    names = plain_names(module)
    own = {names[key]: value for key, value in module.state_dict().items()}
    state = _by_plain_name(state, own)
    shape = {k: _shape(v) for k, v in own.items()}
    wrong_shape = [k for k in own if k in state and _shape(state[k]) != shape[k]]
    problems = "".join(
        f"\n  {title}: {', '.join(keys)}"
        for title, keys in [
            ("missing from the checkpoint", [k for k in own if k not in state]),
            ("not in the model", [k for k in state if k not in own]),
            (
                "shapes differ",
                [f"{k} {_shape(state[k])} vs {shape[k]}" for k in wrong_shape],
            ),
        ]
        if keys
    )
    matching = [k for k in state if k in own and k not in wrong_shape]
    hint = _prefix_hint(list(state), list(own)) if problems else ""
    if problems and strict:
        raise RuntimeError(
            f"Checkpoint {path!r} does not match the model:{problems}\nIf the model changed on "
            "purpose, train it in a new work_dir, or pass train(auto_resume=False) to start "
            "afresh in this one. To fine-tune from these weights instead, loading those that "
            f"match: load_checkpoint(path, resume=False, strict=False).{hint}"
        )
    if problems and not matching:  # strict=False would load nothing, and say it succeeded
        raise RuntimeError(
            f"Checkpoint {path!r} holds no weight that matches the model in name and shape: its "
            f"keys begin {_first(state)}, the model's {_first(own)}.{hint}"
        )
    if problems:
        logger.warning(
            f"Loading {path} with strict=False loaded {len(matching)} of the model's {len(own)} "
            f"entries and skipped:{problems}"
        )
        state = {k: state[k] for k in matching}
    if sharded:  # torch's helper names the weights as the uncompiled model does
        load_full_model_state(module, state, strict)
    else:
        key = {name: key for key, name in names.items()}
        module.load_state_dict({key[name]: value for name, value in state.items()}, strict=strict)


def _by_plain_name(state: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """``state`` with a key the model lacks renamed to the model's uncompiled name, if it is
    that name with torch.compile's ``_orig_mod.`` inside (from a model compiled elsewhere) and
    no other key of ``state`` has that name (a clash leaves the key as it is, not loaded)."""
    renamed = {}
    for key, value in state.items():
        plain = ".".join(part for part in key.split(".") if part != "_orig_mod")
        fits = key not in own and plain in own and plain not in state and plain not in renamed
        renamed[plain if fits else key] = value
    return renamed


def model_weights(data: dict[str, Any], path: str) -> dict[str, Any]:
    """The model's ``state_dict`` in a file of weights: a dict holding it under
    ``"state_dict"``, ``"model_state_dict"`` (PyTorch's tutorials) or ``"model"`` (a trainer
    checkpoint), or the file's dict itself."""
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(data.get(key), dict):
            data = data[key]
            break
    if not any(isinstance(value, torch.Tensor) for value in data.values()):
        raise RuntimeError(
            f"Checkpoint {path!r} holds no weights: expected a model's state_dict (names to "
            f"tensors), or a dict holding one under 'state_dict', 'model_state_dict' or 'model'; "
            f"its keys are {_first(data)}."
        )
    return data


def load_optimizer_state(
    module: nn.Module, optimizer: Optimizer, state: dict[str, Any], path: str, sharded: bool
) -> None:
    """Load an optimizer's checkpointed state; sharded models' checkpoints key it by name."""
    if keyed_by_name(state):
        load_full_optimizer_state(module, optimizer, state)
    elif sharded:
        raise RuntimeError(
            f"Checkpoint {path!r} was saved by a model that was not sharded; this one is "
            "(fully_shard), and the optimizer state cannot be mapped. Resume it without "
            "sharding, or load the weights alone: load_checkpoint(path, resume=False)."
        )
    else:
        optimizer.load_state_dict(state)


def check_revise_keys(revise_keys: Any, resume: bool) -> None:
    """Refuse ``revise_keys`` that are not ``(regex, replacement)`` pairs of strings, or that
    come with ``resume=True``, whose checkpoint is loaded as it was saved."""
    if resume:
        raise ValueError(
            "revise_keys renames the weights of a file loaded with resume=False (fine-tuning, "
            "evaluation); a resumed run loads its own checkpoint as saved. Pass resume=False."
        )
    pairs = list(revise_keys) if isinstance(revise_keys, (list, tuple)) else None
    if pairs is None or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p)
        for p in pairs
    ):
        raise TypeError(
            f"revise_keys must be a list of (regex, replacement) pairs of strings, got "
            f"{revise_keys!r}; e.g. revise_keys=[(r'^module\\.', '')]."
        )
    for pattern, replacement in pairs:
        try:
            re.sub(pattern, replacement, "")  # parses both: a bad group reference raises too
        except (re.error, IndexError) as e:  # IndexError: an unknown group name
            raise ValueError(
                f"revise_keys holds ({pattern!r}, {replacement!r}), which re.sub refuses: {e}."
            ) from None


def revised(
    state: dict[str, Any], revise_keys: Sequence[tuple[str, str]], path: str
) -> dict[str, Any]:
    """``state`` with its keys renamed by ``revise_keys``, in order; two keys renamed alike
    are refused (one would be lost)."""
    for pattern, replacement in revise_keys:
        renamed: dict[str, Any] = {}
        for key, value in state.items():
            new = re.sub(pattern, replacement, key)
            if new in renamed:
                raise ValueError(
                    f"revise_keys ({pattern!r} -> {replacement!r}) renames two keys of "
                    f"{path!r} to {new!r}: one would be lost. Make the renaming one to one."
                )
            renamed[new] = value
        state = renamed
    return state


def _shape(value: Any) -> Any:
    """A tensor's shape as a tuple, for comparing and naming; another value's type."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _first(keys: Any, n: int = 3) -> str:
    keys = list(keys)
    return f"{keys[:n]}{' ...' if len(keys) > n else ''} ({len(keys)} in all)"


def _prefix_hint(theirs: list[str], ours: list[str]) -> str:
    """A ``revise_keys`` that would match the file's keys to the model's, if they differ by a
    prefix (``module.`` of a DDP checkpoint, say)."""
    for keys, others, add in ((theirs, ours, False), (ours, theirs, True)):
        common = os.path.commonprefix(keys)
        for end in (i + 1 for i, c in enumerate(common) if c == "."):
            if {k[end:] for k in keys} & set(others):
                prefix = common[:end]
                pair = ("^", prefix) if add else ("^" + re.escape(prefix), "")
                return (
                    " The keys differ by a prefix: load_checkpoint(path, resume=False, "
                    f"revise_keys=[{pair!r}]) renames them."
                )
    return ""
