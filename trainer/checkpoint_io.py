"""Checkpoint bytes and what they may hold: the one background runner, atomic writes, the file
format (one ``torch.save`` zip, checked and loaded through one open file), the one walk of a
nested state (plain data only, copied to CPU), and putting loaded weights into a model. What a
checkpoint holds and where it goes is ``checkpoint.py``'s."""

import collections
import logging
import os
import pickle
import re
import shutil
import threading
import zipfile
from collections.abc import Collection
from typing import Any, Callable, NoReturn, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from .distributed import all_gather, get_world_size, is_dtensor, is_main_process, is_sharded
from .fsdp import (
    full_state_dicts,
    keyed_by_name,
    load_full_model_state,
    load_full_optimizer_state,
)
from .misc import plain_names, unwrapped

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"  # the end of a file or folder being written, which a start removes
ASIDE_SUFFIX = TEMP_SUFFIX + ".old"  # of a checkpoint moved aside while another replaces it


# Work in the background


class Background:
    """Runs one function at a time on a thread; [`submit`][] and [`wait`][] raise what the
    previous one raised. Not a daemon: an exiting interpreter finishes a checkpoint write."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.failed = False  # the work raised, and wait() has not raised it yet

    def submit(self, work: Callable[[], None]) -> None:
        """Wait for the previous work, then start ``work()``."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(work,), name=self._name)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the work in flight, if any; raise what it raised."""
        if self._thread is not None:
            # Short joins: a signal that lands as a join begins waits for the next one, not for
            # the end of the work (a bare join can hold a Ctrl-C until the write ends).
            while self._thread.is_alive():
                self._thread.join(0.1)
            self._thread = None
        if self._error is not None:
            error = self._error
            self._error = None
            self.failed = False
            raise error

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # handed to the waiting thread
            self._error = e
            self.failed = True


# Writing


def atomic_write(path: str, write: Callable[[Any], Any]) -> None:
    """Write ``path`` through ``write(binary file)`` so that it is untouched or complete: a
    temporary file beside it, fsynced, then [`replace`][]-d. The file gets the permissions
    the umask gives any new file."""
    temp = temp_path(path)
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        replace(temp, path)
    except BaseException:
        if os.path.lexists(temp):
            os.remove(temp)
        raise


def temp_path(path: str) -> str:
    """Where ``path`` is written before it takes its name (hidden, beside it)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TEMP_SUFFIX}")


def replace(temp: str, path: str) -> None:
    """Give the complete file or folder ``temp`` the name ``path``, durably. What ``os.replace``
    cannot replace (a folder, or a file by a folder) is moved aside first and deleted after: a
    crash between the renames leaves it there, and the next start puts it back."""
    aside = None
    if os.path.lexists(path) and (os.path.isdir(temp) or _is_folder(path)):
        folder, name = os.path.split(path)
        aside = os.path.join(folder, f".{name}{ASIDE_SUFFIX}")
        os.replace(path, aside)
    os.replace(temp, path)
    fsync_folder(os.path.dirname(os.path.abspath(path)))
    if aside is not None:
        remove_checkpoint(aside)


def _is_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


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
    if _is_folder(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def raise_write_failure(path: str, error: BaseException) -> NoReturn:
    """Raise ``error``, as an ``OSError`` naming ``path`` and what is kept where an ``OSError``
    is behind it (torch.save reports a full disk as a RuntimeError, the OSError its context)."""
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        raise error
    message = (
        f"Could not write {path}: {cause.strerror or cause}. The previous checkpoint and "
        "latest.txt are untouched; free disk space or pick another work_dir."
    )
    raise (OSError(cause.errno, message) if cause.errno else OSError(message)) from error


# Plain data: what torch.load(weights_only=True) rebuilds as it was saved

# Values of exactly these types (a subclass, such as an enum, does not load).
_ATOMS = frozenset({str, bytes, int, float, complex, bool, type(None), torch.dtype})
_ATOMS |= {torch.device, torch.Size}
# Any other mapping (a defaultdict, say) is refused: as a dict it would lose its behaviour.
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)
# A Parameter is saved as the plain tensor it holds; another subclass's type would not load.
_TENSORS = (torch.Tensor, torch.nn.Parameter)
# NumPy scalars that become Python numbers computing the same (np.float64 is a Python float).
_NUMPY_AS_PYTHON = (np.bool_, np.integer, np.float64)


class UnloadableState(TypeError):
    """A ``value`` at ``path`` (keys and indices) of a state that
    ``torch.load(weights_only=True)`` cannot rebuild."""

    def __init__(self, path: tuple, value: Any) -> None:
        super().__init__(f"{type(value).__name__} at {list(path)}")
        self.path = path
        self.value = value


def walk(obj: Any, tensor: Callable[[tuple, torch.Tensor], Any], path: tuple = ()) -> Any:
    """``obj`` rebuilt by what it holds (never by ``type(obj)(items)``), ``tensor(path, t)`` in
    place of each tensor ``t``; NumPy bools, ints and float64s as Python numbers. Anything else
    raises [`UnloadableState`][]."""
    kind = type(obj)
    if kind in _ATOMS:
        return obj
    if kind in _TENSORS or (isinstance(obj, torch.Tensor) and is_dtensor(obj)):
        return tensor(path, obj)
    if kind in _MAPPINGS:
        items = {walk(k, tensor, (*path, k)): walk(v, tensor, (*path, k)) for k, v in obj.items()}
        return items if kind is dict else kind(items)
    if kind is list or kind is tuple:
        return kind([walk(value, tensor, (*path, i)) for i, value in enumerate(obj)])
    if kind is set:
        return {walk(value, tensor, (*path, "{...}")) for value in obj}
    if isinstance(obj, _NUMPY_AS_PYTHON):
        return obj.item()
    raise UnloadableState(path, obj)


def named_tensors(state: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors in ``state``, named by their keys joined with dots (``optimizer.0.exp_avg``)."""
    found: list[tuple[str, torch.Tensor]] = []
    walk(state, lambda path, t: found.append((".".join(map(str, path)), t)))
    return found


def copy_to_cpu(state: Any) -> Any:
    """A copy of ``state`` that training cannot change, as plain data (see [`walk`][]); CUDA
    tensors are copied through pinned memory, with one sync for all."""
    copied_from_cuda: set[torch.device] = set()

    def copy_tensor(path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor.detach().clone()
        copied_from_cuda.add(tensor.device)
        return tensor.detach().to("cpu", non_blocking=True)  # lands in pinned memory

    result = walk(state, copy_tensor)
    for device in copied_from_cuda:
        torch.cuda.current_stream(device).synchronize()  # the copies are done when this returns
    return result


def bad_tensors(data: dict[str, Any], parameters: Collection[str]) -> list[str]:
    """The names of the tensors in ``data`` no run should go on from: not finite, except model
    buffers, which only a NaN makes bad (a causal mask's -inf is on purpose). One host read per
    device, and one more where a sum is not finite."""
    buffers = {f"model.{key}" for key in data.get("model", {}) if key not in parameters}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors(data):
        local = tensor.to_local() if is_dtensor(tensor) else tensor  # a DTensor's shard
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


def check_rank_state(state: dict[str, Any], group: Any, check_buffers: bool) -> bool:
    """Of an FSDP2 model's checkpoint, refuse DTensors outside the model and optimizer (rank 0
    writes that part alone: every rank would resume with its shard), and, if ``check_buffers``,
    name in a warning the model buffers that differ by rank (one copy is kept). A collective of
    ``group``. Returns whether it warned."""
    rest = {key: value for key, value in state.items() if key not in ("model", "optimizer")}
    tensors = named_tensors(rest)
    shards = sorted({".".join(name.split(".")[:2]) for name, t in tensors if is_dtensor(t)})
    if shards:
        raise ValueError(f"{', '.join(shards)} holds DTensors: keep their full_tensor() there.")
    if get_world_size() == 1 or not check_buffers:
        return False
    buffers = {
        name: t
        for name, t in state["model"].items()
        if isinstance(t, torch.Tensor) and not is_dtensor(t) and t.is_floating_point()
    }
    sums = torch.stack([t.double().sum() for t in buffers.values()]).tolist() if buffers else []
    everyone = all_gather(sums, group=group)
    differ = [name for i, name in enumerate(buffers) if len({s[i] for s in everyone}) > 1]
    if differ:
        logger.warning(
            f"The model's buffers {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''} "
            "differ by rank (FSDP2 does not synchronize them) and a checkpoint keeps one copy: "
            "a resumed run is not exact. Use SyncBatchNorm to keep them equal."
        )
    return bool(differ)


# The file format: one torch.save zip


class FileFormat:
    """A checkpoint as one ``torch.save`` file of the whole state, which rank 0 writes (an FSDP2
    model's full state, which every rank gathers for it)."""

    in_background = True  # every write runs on the writer's thread

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        self._model = model
        self._optimizer = optimizer

    def write(self, state: dict[str, Any], temp: str) -> Optional[Callable[[Callable], None]]:
        """Copy ``state`` (its tensors may be live) for the function returned on rank 0 (None
        on the others), which writes it as ``temp`` and then calls ``publish()``. Every rank
        calls it."""
        full = full_state_dicts(self._model, self._optimizer) if is_sharded(self._model) else {}
        if not is_main_process():
            return None
        # the gathered full states are fresh CPU tensors already: no second copy
        copied = {**copy_to_cpu({k: v for k, v in state.items() if k not in full}), **full}

        def write(publish: Callable[[], None]) -> None:
            with open(temp, "wb") as f:
                torch.save(copied, f)
                f.flush()
                os.fsync(f.fileno())
            publish()

        return write

    def read(self, path: str, check: Callable[[dict], None]) -> dict[str, Any]:
        """The checkpoint file at ``path``, once ``check(data)`` and its CRCs hold and the model's
        and optimizer's tensors are finite."""

        def check_all(data: dict[str, Any]) -> None:
            check(data)
            state = {"model": data["model"], "optimizer": data["optimizer"]["state"]}
            refuse_non_finite(bad_tensors(state, parameters(unwrapped(self._model))), path)

        return read_file(path, check_all)


def read_file(path: str, check: Optional[Callable[[dict], None]] = None) -> dict[str, Any]:
    """Load a ``torch.save`` file with ``weights_only=True`` while a thread checks the CRC-32
    of each of its zip records; both read one open file, so a file replaced meanwhile is not
    mixed in. ``check(data)`` runs before the CRCs are known; damage is raised first."""
    with open(path, "rb") as f:
        crcs = Background("checkpoint-check")
        crcs.submit(lambda: _check_records(f.fileno(), path))
        error: Optional[Exception] = None
        try:
            data = _load(f, path)
            if check is not None:
                check(data)
        except Exception as e:
            error = e
        crcs.wait()  # first: damage says more than what torch.load or the checks made of it
    if error is not None:
        raise error
    return data


class _At:
    """A read-only file over a descriptor (``os.pread``: the descriptor's offset, which
    torch.load moves, stays as it is)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._at = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self._at}.get(whence)
        self._at = (os.fstat(self._fd).st_size if start is None else start) + offset
        if self._at < 0:  # an offset of a damaged archive
            raise ValueError("seek before the start of the file")
        return self._at

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = os.fstat(self._fd).st_size - self._at
        data = os.pread(self._fd, n, self._at)
        self._at += len(data)
        return data


def _check_records(fd: int, path: str) -> None:
    """Raise a RuntimeError naming ``path`` as damaged unless every record of the zip archive
    on ``fd`` has its CRC-32."""
    try:
        with zipfile.ZipFile(_At(fd)) as archive:
            for record in archive.infolist():
                # zipfile ignores this flag; torch's reader takes such a record for a directory
                # and loads nothing into its tensor (the one bit a record's CRC does not cover)
                if record.external_attr & 0x10:
                    raise zipfile.BadZipFile(f"{record.filename} is marked as a directory")
                with archive.open(record) as f:
                    while f.read(16 << 20):
                        pass
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError, RuntimeError) as e:
        if isinstance(e.__context__, OSError):  # zipfile's word for a file it could not read
            raise e.__context__ from None
        raise RuntimeError(f"Checkpoint {path!r} is damaged or no torch.save file ({e}).") from None


def _load(f: Any, path: str) -> dict[str, Any]:
    """``torch.load(f, weights_only=True)``; what it refuses is a RuntimeError naming ``path``,
    never with torch's advice to load it with ``weights_only=False``."""
    try:
        data = torch.load(f, map_location="cpu", weights_only=True)
    except (OSError, MemoryError):
        raise
    except Exception as e:
        blocked = re.search(r"GLOBAL (\S+) whose module \S+ is blocked", str(e))
        if isinstance(e, pickle.UnpicklingError) and blocked:  # code: a crafted file
            raise RuntimeError(
                f"Checkpoint {path!r} could not be loaded safely: it would call {blocked[1]}."
            ) from None
        if isinstance(e, pickle.UnpicklingError) and "GLOBAL " in str(e):  # a class of yours
            raise RuntimeError(f"Checkpoint {path!r} could not be loaded safely: {e}") from e
        raise RuntimeError(
            f"Checkpoint {path!r} is damaged ({type(e).__name__} in torch.load)."
        ) from None
    if not isinstance(data, dict):
        raise RuntimeError(f"Checkpoint {path!r} holds a {type(data).__name__}, not a dict.")
    return data


# Loaded weights


def parameters(module: nn.Module) -> set[str]:
    """The names of ``module``'s parameters in a checkpoint (a tied weight's every one)."""
    names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    return set(plain_names(module, names).values())


def refuse_non_finite(bad: list[str], path: str) -> None:
    """Raise a RuntimeError naming ``path`` if ``bad`` names tensors (see [`bad_tensors`][])."""
    if bad:
        raise RuntimeError(f"Checkpoint {path!r} holds NaN or infinite values in {bad[:5]}.")


def load_model_state(
    module: nn.Module, state: dict[str, Any], path: str, strict: bool, sharded: bool
) -> None:
    """Load checkpointed weights into ``module`` (the unwrapped model), listing the keys and
    shapes that differ; ``strict=False`` loads those that match. Keys match by the names of the
    uncompiled model, whichever of its modules torch.compile wrapped when saved or now."""
    names = plain_names(module)
    own = {names[key]: value for key, value in module.state_dict().items()}
    state = _by_plain_name(state, own)
    wrong_shape = [k for k in own if k in state and _shape(state[k]) != _shape(own[k])]
    differences = [
        ("missing from the checkpoint", [k for k in own if k not in state]),
        ("not in the model", [k for k in state if k not in own]),
        ("shapes differ", [f"{k} {_shape(state[k])} vs {_shape(own[k])}" for k in wrong_shape]),
    ]
    problems = "".join(f"\n  {title}: {', '.join(keys)}" for title, keys in differences if keys)
    matching = [k for k in state if k in own and k not in wrong_shape]
    hint = _prefix_hint(list(state), list(own)) if problems else ""
    if problems and strict:
        raise RuntimeError(
            f"Checkpoint {path!r} does not match the model:{problems}\n"
            f"Train it in a new work_dir, or fine-tune: resume=False, strict=False.{hint}"
        )
    if problems and not matching:  # strict=False would load nothing, and say it succeeded
        raise RuntimeError(
            f"Checkpoint {path!r} holds none of the model's weights: its keys {_first(state)}, "
            f"the model's {_first(own)}.{hint}"
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


def model_weights(data: dict[str, Any]) -> dict[str, Any]:
    """The model's ``state_dict`` in a file of weights: a dict holding it under
    ``"state_dict"``, ``"model_state_dict"`` (PyTorch's tutorials) or ``"model"`` (a trainer
    checkpoint), or the file's dict itself (one without weights matches no model's keys)."""
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(data.get(key), dict):
            data = data[key]
            break
    return data


def load_optimizer_state(
    module: nn.Module, optimizer: Optimizer, state: dict[str, Any], path: str, sharded: bool
) -> None:
    """Load an optimizer's checkpointed state; sharded models' checkpoints key it by name."""
    if keyed_by_name(state):
        load_full_optimizer_state(module, optimizer, state)
    elif sharded:
        raise RuntimeError(f"Checkpoint {path!r} is of an unsharded model: pass resume=False.")
    else:
        optimizer.load_state_dict(state)


def check_revise_keys(revise_keys: Any, resume: bool) -> None:
    """Refuse ``revise_keys`` that are not ``(regex, replacement)`` pairs of strings, or that
    come with ``resume=True``, whose checkpoint is loaded as it was saved."""
    if resume:
        raise ValueError("revise_keys renames the weights of a load with resume=False only.")
    pairs = list(revise_keys) if isinstance(revise_keys, (list, tuple)) else None
    if pairs is None or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p)
        for p in pairs
    ):
        raise TypeError(f"revise_keys must be a list of (regex, replacement), got {revise_keys!r}.")


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
                raise ValueError(f"revise_keys renames two keys of {path!r} to {new!r}.")
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
