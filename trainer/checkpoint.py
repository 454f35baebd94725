"""Checkpoints: what they hold (:class:`Checkpointer` gathers and restores the trainer's
state), their names, atomic background writes, a ``latest.txt`` pointer, ``weights_only``
loads and the search for the newest one that loads."""

import copy
import glob
import logging
import os
import tempfile
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from .distributed import gather, is_main_process
from .fsdp import (
    full_state_dicts,
    is_sharded,
    keyed_by_name,
    load_full_model_state,
    load_full_optimizer_state,
)
from .progress import DataStream, Progress, map_position
from .step import wrappers

logger = logging.getLogger(__name__)

LATEST_POINTER = "latest.txt"
_TEMP_SUFFIX = ".tmp"
# What a checkpoint needs to resume a run (a weights-only load needs "model" alone).
RESUME_KEYS = ("progress", "config", "model", "optimizer", "lr_scheduler", "grad_scaler",
               "metric_storage", "hooks", "rng")  # fmt: skip


class Checkpointer:
    """Gathers the trainer's whole state into checkpoints and restores it.

    A checkpoint is a dict of tensors and plain data (it loads with ``weights_only=True``):
    ``model`` (the unwrapped module's weights), ``optimizer``, the ``parts`` (LR scheduler,
    GradScaler, metrics), ``hooks`` (each stateful hook's state), ``extra`` (what
    :meth:`register` added), ``rng`` (per rank), ``progress`` and ``config``.

    Args:
        ckpt_dir: The checkpoint folder.
        model: The model as trained (wrapped, compiled or sharded, maybe).
        optimizer: The trainer's optimizer.
        progress: Where training is; saved, and moved on resume.
        data: The data passes, whose RNG states are saved.
        parts: Top-level keys and the objects (with ``state_dict()`` and ``load_state_dict()``)
            saved under them.
        hooks: Returns the stateful hooks by key.
        config: What a resumed run must match: ``accumulation_steps`` (refused if changed) and
            ``amp`` (reported if changed).
        batch_size: Per process, to map the position when it changes on resume.
    """

    def __init__(
        self,
        ckpt_dir: str,
        model: nn.Module,
        optimizer: Optimizer,
        progress: Progress,
        data: DataStream,
        parts: dict[str, Any],
        hooks: Callable[[], dict[str, Any]],
        config: dict[str, Any],
        batch_size: Optional[int],
    ) -> None:
        self.ckpt_dir = ckpt_dir
        self._model = model
        self._optimizer = optimizer
        self._progress = progress
        self._data = data
        self._parts = parts
        self._hooks = hooks
        self._config = config
        self._batch_size = batch_size
        self._extra: dict[str, Any] = {}
        self._sharded = is_sharded(model)  # by FSDP2's fully_shard
        self._writer = BackgroundWriter()

    @property
    def _module(self) -> nn.Module:
        *_, module = wrappers(self._model)
        return module

    def register(self, name: str, obj: Any) -> None:
        """Save ``obj``'s state under ``extra[name]`` and restore it on resume."""
        if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(
                f"register_checkpointable({name!r}, ...) needs an object with state_dict() and "
                f"load_state_dict() (an optimizer, scheduler or module), got {type(obj).__name__}."
            )
        if name in self._extra:
            raise ValueError(f"A checkpointable named {name!r} is registered already.")
        self._extra[name] = obj

    def save(self, file_name: str, then: Optional[Callable[[], None]] = None) -> Optional[str]:
        """Save the state as ``ckpt_dir/file_name`` in the background; a collective (every rank
        hands rank 0 its RNG state), returning the path on rank 0 and None elsewhere."""
        self._progress.mark_saved()
        # FSDP2: every rank takes part in gathering the full weights, which rank 0 writes.
        weights = full_state_dicts(self._model, self._optimizer) if self._sharded else None
        # Per-rank RNG, so every rank's dropout and data-worker seeds resume exactly.
        rng = gather(self._data.rng_state(mid_pass=self._progress.position[1] > 0))
        if not is_main_process():
            return None
        path = os.path.join(self.ckpt_dir, file_name)
        save_in_background(self._writer, lambda: self._state_dict(rng, weights), path, then)
        return path

    def wait(self) -> None:
        """Wait for the write in flight; raise its error, if any."""
        self._writer.wait()

    def remove_temp_files(self) -> None:
        """On rank 0, delete what writes interrupted by a crash left behind."""
        if is_main_process():
            for stray in remove_temp_files(self.ckpt_dir):
                logger.info(f"Removed {stray}, left by an interrupted checkpoint write.")

    def _state_dict(self, rng: list[dict], weights: Optional[tuple]) -> dict[str, Any]:
        state = {
            "progress": self._progress.state_dict(self._batch_size),
            "config": self._config,
            **{key: part.state_dict() for key, part in self._parts.items()},
            "hooks": {key: hook.state_dict() for key, hook in self._hooks().items()},
            "extra": {name: obj.state_dict() for name, obj in self._extra.items()},
            "rng": rng,
        }
        if weights is None:
            state["model"] = self._module.state_dict()
            state["optimizer"] = self._optimizer.state_dict()
        state = copy_to_cpu(state)
        if weights is not None:  # gathered into fresh CPU tensors already: no second copy
            state["model"], state["optimizer"] = weights
        return state

    def load(self, path: Optional[str], auto_resume: bool, resume: bool, strict: bool) -> bool:
        """See :meth:`Trainer.load_checkpoint`."""
        self.wait()  # a write in flight may be the newest checkpoint
        if path is None:
            if not auto_resume:
                raise ValueError("Pass a checkpoint path, or auto_resume=True to use the latest.")
            found = load_newest(self.ckpt_dir)
            if found is None:
                logger.info(f"No checkpoint in {self.ckpt_dir}: training from scratch.")
                return False
            path, data = found
        else:
            data = load_checkpoint_file(path)
            check_keys(data, path, RESUME_KEYS if resume else ("model",))
        load_model_state(self._module, data["model"], path, strict, self._sharded)
        if not resume:
            logger.info(f"Loaded model weights from {path}; the training state is not restored.")
            return True
        self._load_state_dict(data, path)
        logger.info(f"Resumed from checkpoint {path} at iteration {self._progress.start_iter}.")
        return True

    def _load_state_dict(self, data: dict[str, Any], path: str) -> None:
        check_config(data["config"], self._config, path)
        progress = self._progress
        accumulation = self._config["accumulation_steps"]
        position = map_position(
            data["progress"], path, progress.epoch_len, self._batch_size, accumulation
        )
        load_optimizer_state(self._module, self._optimizer, data["optimizer"], path, self._sharded)
        for key, part in self._parts.items():
            part.load_state_dict(data[key])
        for kind, owners, states in (
            ("hook", self._hooks(), data["hooks"]),
            ("checkpointable", self._extra, data.get("extra", {})),
        ):
            for key, owner in owners.items():
                if key in states:
                    owner.load_state_dict(states[key])
                else:
                    logger.warning(f"Checkpoint {path} holds no state for {kind} {key!r}.")
            for key in states.keys() - owners.keys():
                logger.warning(f"Checkpoint {path} has state for {kind} {key!r}, not registered.")
        # A checkpoint from an epoch's last iteration (a preemption there) resumes with the
        # epoch's end: the next pass starts fresh, nothing to skip.
        inner = position[1]
        self._data.resume(
            data["rng"], path, inner * accumulation if inner < progress.epoch_len else 0
        )
        progress.resume(position, data["progress"].get("stopped", False))


def checkpoint_name(by_epoch: bool, position: tuple[int, int], iters_done: int) -> str:
    """The file name of a checkpoint taken at ``position`` (epoch, iterations done in it):
    ``epoch_{N}.pth`` at an epoch's end in epoch-based training (N epochs done), otherwise
    ``iter_{N}.pth`` (N iterations done)."""
    epoch, inner = position
    if by_epoch and inner == 0:
        return f"epoch_{epoch}.pth"
    return f"iter_{iters_done}.pth"


def save_in_background(
    writer: "BackgroundWriter",
    state: Callable[[], dict[str, Any]],
    path: str,
    then: Optional[Callable[[], None]] = None,
) -> None:
    """Write ``state()`` to ``path`` on ``writer``'s thread, then point ``latest.txt`` at it.

    Waits for the previous write first (and raises its error), then copies the state to CPU
    memory: training may change the tensors once this returns.
    """
    writer.wait()  # one write at a time; raises if the previous one failed
    copied = copy_to_cpu(state())
    ckpt_dir, file_name = os.path.split(path)

    def write() -> None:
        atomic_save(copied, path)
        update_latest_pointer(ckpt_dir, file_name)
        logger.info(f"Saved checkpoint {path}")
        if then is not None:
            then()

    writer.submit(write)


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` that leaves ``path`` either untouched or complete, never half-written.

    The data goes to a temporary file in the same folder, is flushed to disk, and replaces
    ``path`` in one ``os.replace``; the folder is then synced so the rename itself is durable.
    """
    _atomic_write(path, lambda f: torch.save(obj, f))


def update_latest_pointer(ckpt_dir: str, file_name: str) -> None:
    """Point ``ckpt_dir/latest.txt`` at ``file_name``, atomically (works where symlinks do not)."""
    _atomic_write(os.path.join(ckpt_dir, LATEST_POINTER), lambda f: f.write(file_name.encode()))


def read_latest_pointer(ckpt_dir: str) -> Optional[str]:
    """The path ``latest.txt`` names, or None when there is no pointer yet."""
    pointer = os.path.join(ckpt_dir, LATEST_POINTER)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    return os.path.join(ckpt_dir, name) if name else None


def list_checkpoints(ckpt_dir: str) -> list[str]:
    """The ``.pth`` files in ``ckpt_dir``, newest first: the one ``latest.txt`` names leads."""
    paths = sorted(
        glob.glob(os.path.join(ckpt_dir, "*.pth")), key=lambda p: (os.path.getmtime(p), p)
    )[::-1]
    latest = read_latest_pointer(ckpt_dir)
    if latest in paths:
        paths.remove(latest)
        paths.insert(0, latest)
    return paths


def remove_temp_files(ckpt_dir: str) -> list[str]:
    """Delete the temporary files that writes interrupted by a crash left behind."""
    stray = glob.glob(os.path.join(ckpt_dir, f".*{_TEMP_SUFFIX}"))
    for path in stray:
        os.remove(path)
    return stray


def copy_to_cpu(state: Any) -> Any:
    """A copy of ``state`` (nested dicts, lists and tuples) that training cannot change under it.

    Tensors are copied to CPU memory (CUDA ones through pinned memory, with one sync for all);
    everything else is deep-copied.
    """
    copied_from_cuda = []

    def copy_(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu":
                return obj.detach().clone()
            copied_from_cuda.append(obj.device)
            return obj.detach().to("cpu", non_blocking=True)  # lands in pinned memory
        if isinstance(obj, dict):
            return type(obj)((k, copy_(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(copy_(v) for v in obj)
        return copy.deepcopy(obj)

    result = copy_(state)
    for device in set(copied_from_cuda):
        torch.cuda.current_stream(device).synchronize()  # the copies are done when this returns
    return result


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
            error, self._error = self._error, None
            raise error

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # handed to the training thread at its next wait()
            self._error = e


def load_checkpoint_file(path: str) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``: tensors and plain data only, never code."""
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


def _atomic_write(path: str, write) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.", suffix=_TEMP_SUFFIX, dir=folder
        )
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
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            message = (
                f"Could not write {path}: {e.strerror or e}. The previous checkpoint and "
                "latest.txt are untouched; free disk space or pick another work_dir."
            )
            # OSError(None, message) would read "[Errno None] ..."
            raise (OSError(e.errno, message) if e.errno else OSError(message)) from e
        raise


def check_keys(data: dict[str, Any], path: str, keys: tuple[str, ...]) -> None:
    """Raise a RuntimeError naming ``path`` when ``data`` lacks any of ``keys``."""
    missing = [k for k in keys if k not in data]
    if missing:
        raise RuntimeError(
            f"Checkpoint {path!r} lacks {missing}: it was not written by trainer.save_checkpoint. "
            "For weights alone, use load_checkpoint(path, resume=False)."
        )


def load_newest(ckpt_dir: str) -> Optional[tuple[str, dict[str, Any]]]:
    """The newest checkpoint in ``ckpt_dir`` that loads and can resume a run, ``latest.txt``'s
    first, as ``(path, data)``; None when there is none. One that fails to load is skipped with
    a warning; if none loads, this raises rather than let training start from scratch."""
    failures = []
    for path in list_checkpoints(ckpt_dir):
        try:
            data = load_checkpoint_file(path)
            check_keys(data, path, RESUME_KEYS)
        except RuntimeError as e:
            logger.warning(f"Skipping a checkpoint that does not load: {e}")
            failures.append(str(e))
            continue
        if failures:
            logger.warning(f"Resuming from {path}, the newest checkpoint that loads.")
        return path, data
    if failures:
        raise RuntimeError(
            f"None of the {len(failures)} checkpoints in {ckpt_dir} loads:\n"
            + "\n".join(failures)
            + "\nMove them out of the folder to start afresh, or pass "
            "resume_from_checkpoint= a good file."
        )
    return None


def load_model_state(
    module: nn.Module, state: dict[str, Any], path: str, strict: bool, sharded: bool
) -> None:
    """Load checkpointed weights into ``module`` (the unwrapped model), listing the keys and
    shapes that differ; ``strict=False`` loads those that match."""
    # weights saved from a torch.compile-d model by other means carry its prefix
    state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
    own = module.state_dict()
    shape = {k: getattr(v, "shape", None) for k, v in own.items()}
    wrong_shape = [k for k in own if k in state and getattr(state[k], "shape", None) != shape[k]]
    problems = "".join(
        f"\n  {title}: {', '.join(keys)}"
        for title, keys in [
            ("missing from the checkpoint", [k for k in own if k not in state]),
            ("not in the model", [k for k in state if k not in own]),
            (
                "shapes differ",
                [f"{k} {tuple(state[k].shape)} vs {tuple(shape[k])}" for k in wrong_shape],
            ),
        ]
        if keys
    )
    if problems and strict:
        raise RuntimeError(
            f"Checkpoint {path!r} does not match the model:{problems}\nTo load only the "
            "weights that match (fine-tuning), call load_checkpoint(path, resume=False, "
            "strict=False)."
        )
    if problems:
        logger.warning(f"Loading {path} with strict=False skipped:{problems}")
        state = {k: v for k, v in state.items() if k in own and k not in wrong_shape}
    if sharded:
        load_full_model_state(module, state, strict)
    else:
        module.load_state_dict(state, strict=strict)


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


def check_config(saved: dict[str, Any], now: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint whose ``accumulation_steps`` differs (the data position would not
    map); warn about a changed AMP setting (training goes on, not bit for bit)."""
    if saved["accumulation_steps"] != now["accumulation_steps"]:
        raise ValueError(
            f"Checkpoint {path!r} was trained with accumulation_steps="
            f"{saved['accumulation_steps']}, this trainer has {now['accumulation_steps']}; "
            "the data position cannot be mapped. Resume with the same accumulation_steps."
        )
    if saved["amp"] != now["amp"]:
        logger.warning(
            f"Checkpoint {path} was trained with AMP {saved['amp']}, this run uses AMP "
            f"{now['amp']}: training goes on, but not bit for bit as the original run would."
        )
