"""Checkpoints as one idea: named things with ``state_dict()`` ([`Checkpointer`][]), written
in one of two formats (a file, ``checkpoint_io.FileFormat``; a folder of shards,
``sharded_checkpoint.ShardedFormat``, imported by the runs that use it), published atomically
under a name in ``work_dir/checkpoints`` with ``latest.txt`` naming the newest, and read back
from the newest that loads."""

import contextlib
import datetime
import glob
import logging
import math
import os
import re
from collections.abc import Iterator
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from .checkpoint_io import (
    ASIDE_SUFFIX,
    TEMP_SUFFIX,
    Background,
    FileFormat,
    UnloadableState,
    atomic_write,
    bad_tensors,
    check_rank_state,
    check_revise_keys,
    fsync_folder,
    load_model_state,
    load_optimizer_state,
    model_weights,
    parameters,
    raise_write_failure,
    read_file,
    refuse_non_finite,
    remove_checkpoint,
    replace,
    revised,
    temp_path,
    walk,
)
from .data import DataStream
from .distributed import (
    CpuGroup,
    all_gather,
    gather,
    get_world_size,
    is_main_process,
    is_sharded,
    raise_on_every_rank,
)
from .misc import check_file_name, plain_state_dict, unwrapped
from .progress import Progress, map_position

logger = logging.getLogger(__name__)

LATEST_POINTER = "latest.txt"  # names the newest checkpoint of its folder
_PERIODIC = re.compile(r"(epoch|iter)_[0-9]+\.pth")  # the names Checkpointer.name() gives
PREVIOUS_RUNS = "previous"  # the folder where a fresh start moves the earlier run's checkpoints
# What every checkpoint holds besides the registered things, in the order they are checked.
_OWN_KEYS = ("progress", "config", "model", "optimizer", "rng")
_PROGRESS_KEYS = ("epoch", "inner_iter", "epoch_len", "iters_done", "world_size", "batch_size")


def _dcp() -> Any:
    """``trainer.sharded_checkpoint``, imported by the runs that save or load a sharded
    checkpoint: it imports torch.distributed.checkpoint, which takes most of a second."""
    from . import sharded_checkpoint  # heavy and optional: DCP

    return sharded_checkpoint


class Checkpointer:
    """What a checkpoint holds, by name, and where it goes (``trainer.checkpointer``;
    ``trainer.save_checkpoint`` first flushes the metrics and tells the hooks).

    A checkpoint holds the model's weights, the optimizer's state, the progress, the config, each
    rank's RNG states, and the ``state_dict()`` of each of ``checkpointables`` and of what
    [`register`][] adds, under its name. Contents: docs/checkpoints.md.

    Args:
        ckpt_dir: Where the checkpoints and ``latest.txt`` are.
        model: The trainer's model (its unwrapped module's weights are saved).
        optimizer: The trainer's optimizer.
        progress: Where training is.
        data: The data passes, whose RNG states and position are saved per rank.
        cpu: The trainer's gloo group.
        config: What a resumed run must share (``accumulation_steps``) or is warned about.
        by_epoch: Name a checkpoint at an epoch's end ``epoch_N.pth``.
        checkpointables: Named things with ``state_dict()`` and ``load_state_dict()``.
    """

    def __init__(
        self,
        ckpt_dir: str,
        model: nn.Module,
        optimizer: Optimizer,
        progress: Progress,
        data: DataStream,
        cpu: CpuGroup,
        *,
        config: dict[str, Any],
        by_epoch: bool = True,
        **checkpointables: Any,
    ) -> None:
        self.ckpt_dir = ckpt_dir
        self._model = model
        self._module = unwrapped(model)  # whose weights checkpoints hold
        self._optimizer = optimizer
        self._progress = progress
        self._data = data
        self._batch_size = getattr(data.data_loader, "batch_size", None)  # per process
        self._cpu = cpu
        self._config = config
        self._by_epoch = by_epoch
        self._things: dict[str, Any] = {}
        for name, obj in checkpointables.items():
            self.register(name, obj)
        self._parts = set(checkpointables)  # the trainer's; the rest is the user's
        self.last_path: Optional[str] = None
        """The newest checkpoint on disk: the one loaded, or saved (on rank 0) once its write is
        complete; never one still being written."""
        self._last_done = 0  # the iterations done that last_path holds
        self._skipped: set[str] = set()  # the checkpoints that did not load at the resume
        self._model_sharded = is_sharded(model)  # by FSDP2's fully_shard
        self._buffers_warned = False  # that an FSDP2 model's buffers differ by rank
        self.sharded = self._model_sharded
        """Save sharded checkpoints, a folder of every rank's shards (``sharded_checkpoint.py``):
        the default for FSDP2 models. False: one file of the full state."""
        self.writer = Background("checkpoint-writer")
        self._file = FileFormat(model, optimizer)
        self._shards: Any = None  # the ShardedFormat, once a run uses it

    def register(self, name: str, obj: Any) -> None:
        """Save ``obj.state_dict()`` under ``name`` in every checkpoint and restore it on resume
        with ``obj.load_state_dict()``: an extra optimizer, scheduler or module that an
        overridden step uses, or any object with the two methods, such as state carried from
        one iteration to the next (docs/loop.md, "Carried state")."""
        if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(
                f"checkpointer.register({name!r}, obj) needs state_dict() and load_state_dict()."
            )
        if name in _OWN_KEYS or name in self._things:
            raise ValueError(f"{name!r} is registered already (or the trainer's); pick another.")
        self._things[name] = obj

    @property
    def optimizers(self) -> list[Optimizer]:
        """The trainer's optimizer and the registered ones."""
        extra = [obj for obj in self._things.values() if isinstance(obj, Optimizer)]
        return [self._optimizer, *extra]

    def name_of(self, obj: Any) -> str:
        """The name ``obj`` was registered with; a ValueError if it was not."""
        for name, registered in self._things.items():
            if registered is obj:
                return name
        raise ValueError(
            f"This {type(obj).__name__} is in no checkpoint: checkpointer.register(name, it) first."
        )

    def name(self) -> str:
        """The file name of a checkpoint taken now: ``epoch_{N}.pth`` at an epoch's end in
        epoch-based training, ``iter_{N}.pth`` otherwise (N epochs or iterations done)."""
        epoch, inner = self._progress.position
        if self._by_epoch and inner == 0:
            return f"epoch_{epoch}.pth"
        return f"iter_{self._progress.iter + 1}.pth"

    def path(self, file_name: str) -> str:
        """Where the checkpoint ``file_name`` is: in ``ckpt_dir`` (a name leading out of it
        is refused)."""
        check_file_name("file_name", file_name)
        return os.path.join(self.ckpt_dir, file_name)

    def config(self) -> dict[str, Any]:
        """The ``config`` a checkpoint holds, with the classes of what holds state (a state does
        not fit another class)."""
        classes = {name: type(obj).__name__ for name, obj in self._things.items()}
        return {**self._config, "classes": {"optimizer": type(self._optimizer).__name__, **classes}}

    def state_dict(self) -> dict[str, Any]:
        """Every part's ``state_dict()``, tensors live, but the RNG states ([`save`][]'s)."""
        return {
            "progress": self._progress.state_dict(self._batch_size),
            "config": self.config(),
            "model": plain_state_dict(self._module),
            "optimizer": self._optimizer.state_dict(),
            **{name: obj.state_dict() for name, obj in self._things.items()},
        }

    def _format(self, sharded: bool) -> Any:
        """The file format, or the sharded one (imported when first used)."""
        if not sharded:
            return self._file
        if self._shards is None:
            self._shards = _dcp().ShardedFormat(self._module, self._optimizer, self._cpu)
        return self._shards

    # Saving

    def save(self, file_name: str, then: Optional[Callable[[], None]] = None) -> Optional[str]:
        """Save the whole state as ``ckpt_dir/file_name`` and point ``latest.txt`` at it.

        Training waits only while the state is copied to CPU memory; rank 0 writes the file (or,
        [`sharded`][], every rank its shards) in the background under a temporary name,
        renames it into place and calls ``then()`` once it is durable. The next save,
        [`wait`][] and the end of ``train()`` raise a failed write's ``OSError``. Every rank
        calls this; rank 0 gets the path (other ranks None).
        """
        path = self.path(file_name)
        state = self.state_dict()
        # per rank, so that every rank's dropout and data-worker seeds resume exactly
        own_rng = self._data.rng_state(mid_pass=self._progress.position[1] > 0)
        self._refuse_unloadable(file_name, {**state, "rng": [own_rng]})
        if self._model_sharded:  # what one copy keeps for every rank must be the same
            warn = not self._buffers_warned
            self._buffers_warned |= check_rank_state(state, self._cpu.group, check_buffers=warn)
        self._progress.mark_saved()
        state["rng"] = gather(own_rng, group=self._cpu.group)
        fmt = self._format(self.sharded)
        self.writer.wait()  # one write at a time; raises if the last one failed
        os.makedirs(os.path.dirname(path), exist_ok=True)  # a sub-folder's (file_name="best/x")
        temp = temp_path(path)
        write = fmt.write(state, temp)
        if write is None:  # this rank writes nothing
            return None

        done = self._progress.iter + 1

        def job() -> None:
            try:
                write(lambda: self._publish(temp, path, done, then))
            except BaseException as e:
                # a folder stays for the next start to remove: other ranks may still write there
                if is_main_process() and os.path.isfile(temp):
                    os.remove(temp)
                raise_write_failure(path, e)

        if is_main_process():  # said before the write begins, whose "Saved" line comes after
            if os.path.normpath(path) in self._skipped:
                self._skipped.remove(os.path.normpath(path))
                logger.warning(f"Replacing {path}, which did not load when this run resumed.")
            logger.info(f"Writing checkpoint {path} (after iteration {done}) in the background.")
        if fmt.in_background:
            self.writer.submit(job)
        else:
            job()
        return path if is_main_process() else None

    def _publish(self, temp: str, path: str, done: int, then: Optional[Callable[[], None]]) -> None:
        """Give the complete checkpoint ``temp`` (after iteration ``done``) its name ``path`` and
        point ``latest.txt`` at it (on rank 0, in the writer's thread), then call ``then()``."""
        replace(temp, path)
        folder, name = os.path.split(path)  # a file in a sub-folder gets a latest.txt there
        update_latest_pointer(folder, name)
        self.last_path = path
        self._last_done = done
        logger.info(f"Saved checkpoint {path} (on disk).")
        if then is not None:
            then()

    def newest_on_disk(self) -> tuple[Optional[str], int]:
        """[`last_path`][] and the iterations done that it holds (for the Ctrl-C line)."""
        return self.last_path, self._last_done

    def _refuse_unloadable(self, file_name: str, state: dict[str, Any]) -> None:
        """Refuse a state no resume could use: tensors not finite (as `latest` it would fail
        every rerun alike), or values ``weights_only`` loads cannot rebuild. Ranks agree."""
        unloadable = None  # the message, which the ranks share
        try:
            walk(state, lambda path, tensor: tensor)
        except UnloadableState as e:
            top, *rest = e.path
            owner = f"{top!r}"
            if top == "hooks" and rest:
                owner = f"hook {rest[0]!r}"
                rest = rest[1:]
            elif top == "rng" and rest[1:2] == ["loader"]:  # a stateful data loader's own state
                owner = "the data loader"
                rest = rest[2:]
            value = type(e.value)
            module = "" if value.__module__ == "builtins" else value.__module__.split(".")[0] + "."
            where = "".join(f"[{key!r}]" for key in rest)
            unloadable = (
                f"Not saving {file_name}: the state_dict() of {owner} holds a {module}"
                f"{value.__qualname__} at state_dict(){where}, which torch.load(weights_only=True) "
                "cannot rebuild. Return plain data (docs/checkpoints.md lists the conversions)."
            )
        bad = []
        if unloadable is None:
            checked = {k: v for k, v in state.items() if k not in self._parts and k != "rng"}
            checked["optimizer"] = state["optimizer"]["state"]
            bad = bad_tensors(checked, self.parameters())
        if get_world_size() > 1:  # sharded state differs by rank: every rank must agree
            everyone = all_gather((bad, unloadable, self.writer.failed), group=self._cpu.group)
            if any(failed for *_, failed in everyone):
                self.raise_write_error()
            bad = sorted({name for names, _, _ in everyone for name in names})
            unloadable = next((message for _, message, _ in everyone if message), None)
        if unloadable:
            raise TypeError(unloadable)
        if bad:
            raise FloatingPointError(
                f"Not saving {file_name}: after iteration {self._progress.iter + 1}, {bad[:5]} "
                "hold NaN or infinite values. Lower the LR or clip gradients."
            )

    def wait(self) -> None:
        """Wait for the write in flight; raise its error, if any."""
        self.writer.wait()

    @contextlib.contextmanager
    def on_disk(self) -> Iterator[None]:
        """Run the block once the write in flight is complete, so that it sees (and a summary
        names) only checkpoints on disk, then wait for what the block saved. A failed write's
        error is raised after the block, which runs anyway (it closes the logs)."""
        try:
            self.wait()
        finally:
            try:
                yield
            finally:
                self.wait()

    def raise_write_error(self) -> None:
        """Raise the failed write's error on the rank that failed, elsewhere one pointing at it."""
        self.writer.wait()
        who = "A rank" if self.sharded else "Rank 0"
        raise RuntimeError(f"{who} could not write a checkpoint: its log names the file and why.")

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """What ``train()`` holds for the saves: the gloo group of the background writes of
        sharded checkpoints, under torchrun."""
        if not self.sharded:
            yield
            return
        shards = self._format(True)
        with _dcp().write_group() as shards.write_group:
            try:
                yield
            finally:
                shards.write_group = None

    def remove_temp_files(self) -> None:
        """On rank 0, clear what writes interrupted by a crash left behind: a file or folder
        being written is deleted; a checkpoint moved aside to be replaced is put back if its
        replacement never took its name (every rank calls it, and waits for it)."""
        if is_main_process():
            pattern = os.path.join(glob.escape(self.ckpt_dir), ".*")
            for stray in glob.glob(pattern + TEMP_SUFFIX) + glob.glob(pattern + ASIDE_SUFFIX):
                name = os.path.basename(stray)[1:].removesuffix(ASIDE_SUFFIX)
                original = os.path.join(self.ckpt_dir, name)
                if stray.endswith(ASIDE_SUFFIX) and not os.path.lexists(original):
                    os.replace(stray, original)
                    logger.info(f"Restored {original}, moved aside by an interrupted write.")
                else:
                    remove_checkpoint(stray)
                    logger.info(f"Removed {stray}, left by an interrupted checkpoint write.")
        all_gather("cleaned up", group=self._cpu.group)  # the others then list checkpoints

    def set_aside(self) -> None:
        """On rank 0, move what [`ckpt_dir`][] holds (an earlier run's checkpoints and
        ``latest.txt``) into a new ``ckpt_dir/previous/<date_time>/``, for a run that starts
        afresh: none of them is resumed by a fallback of the new run, nor deleted. Every rank
        calls it, and waits for it."""
        error = None
        names = []
        if is_main_process():
            names = sorted(set(os.listdir(self.ckpt_dir)) - {PREVIOUS_RUNS})
        if names:
            try:
                folder = _new_folder(os.path.join(self.ckpt_dir, PREVIOUS_RUNS))
                for name in names:
                    os.replace(os.path.join(self.ckpt_dir, name), os.path.join(folder, name))
                fsync_folder(self.ckpt_dir)
            except OSError as e:
                error = e
            else:
                listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if names[5:] else "")
                logger.info(
                    f"Starting afresh (auto_resume=False): moved the earlier run's checkpoints "
                    f"({listed}) to {folder}."
                )
        raise_on_every_rank(error, group=self._cpu.group)  # the others then save there

    def parameters(self) -> set[str]:
        """The names of the model's parameters in a checkpoint (a tied weight's every one)."""
        return parameters(self._module)

    # Loading

    def load(
        self,
        path: Optional[str],
        auto_resume: bool,
        resume: bool,
        strict: bool,
        revise_keys: Optional[Sequence[tuple[str, str]]] = None,
    ) -> bool:
        """Load a checkpoint: the whole training state, or only the model's weights; whether
        one was loaded.

        Args:
            path: A checkpoint file, or a sharded checkpoint's folder; it must exist and load.
            auto_resume: With no ``path``, use the newest checkpoint in ``ckpt_dir`` that loads,
                ``latest.txt``'s first. One that fails to load is skipped with a warning; if none
                loads, this raises rather than start from scratch.
            resume: Restore everything (optimizer, LR schedule, GradScaler, progress, RNG,
                metrics, hooks, registered things) to continue the run exactly. False loads the
                model's weights only, for fine-tuning or evaluation, from a trainer checkpoint
                or any file of weights: a ``state_dict``, or a dict holding one under
                ``"state_dict"``, ``"model_state_dict"`` or ``"model"``.
            strict: The model's keys and shapes must match the checkpoint's. False loads the
                weights that match in name and shape and logs what it skipped (fine-tuning a
                changed head, say); a file of which none matches is refused.
            revise_keys: ``[(regex, replacement), ...]`` applied in order to the file's keys
                with ``re.sub`` before loading, with ``resume=False``: ``[("^module[.]", "")]``
                drops the prefix of a checkpoint saved from a DDP model.
        """
        if revise_keys is not None:
            check_revise_keys(revise_keys, resume)
        if path is None and not auto_resume:
            raise ValueError("Pass a checkpoint path, or auto_resume=True to use the latest.")
        self.wait()  # a write in flight may be the newest checkpoint
        auto_picked = path is None
        if path is None:
            candidates = list_checkpoints(self.ckpt_dir)
            if not candidates:
                logger.debug(f"No checkpoint in {self.ckpt_dir}: training from scratch.")
                return False
            path, data = self._load_newest(candidates)
            weights = data["model"]
        elif resume:
            data = self._read(path)
            weights = data["model"]
        elif os.path.isdir(path):
            weights = _dcp().read_weights(path)
        else:
            weights = model_weights(read_file(path))  # weights from anywhere
        weights = revised(weights, revise_keys or (), path)
        if not resume and not auto_picked:  # _load_newest checked the one it picked
            refuse_non_finite(bad_tensors({"model": weights}, self.parameters()), path)
        load_model_state(self._module, weights, path, strict, self._model_sharded)
        if not resume:
            logger.info(f"Loaded model weights from {path}; the training state is not restored.")
            return True
        self._load_state(data, path)
        self.last_path = path
        self._last_done = self._progress.start_iter  # as this run counts them
        done = self._progress.resumed_iters  # the checkpoint's, which max_iters may cut
        logger.info(f"Resumed from checkpoint {path} after iteration {done}.")
        return True

    def _load_state(self, data: dict[str, Any], path: str) -> None:
        """Put back the training state besides the model's weights."""
        _check_config(data["config"], self.config(), path)
        progress = self._progress
        accumulation = self._config["accumulation_steps"]
        position = map_position(
            data["progress"], path, progress.epoch_len, self._batch_size, accumulation
        )
        load_optimizer_state(
            self._module, self._optimizer, data["optimizer"], path, self._model_sharded
        )
        for name, obj in self._things.items():
            if name in data:
                obj.load_state_dict(data[name])
            else:
                logger.warning(f"Checkpoint {path} holds no state for {name!r}: it starts afresh.")
        for name in data.keys() - {*_OWN_KEYS, *self._things}:
            logger.warning(f"Checkpoint {path} holds state for {name!r}, which is not registered.")
        # A checkpoint from an epoch's last iteration (a preemption there) resumes with the
        # epoch's end, which takes the pass to its end as the uninterrupted run did: skipped too.
        inner = position[1]
        remapped = inner != data["progress"]["inner_iter"] or len(data["rng"]) != get_world_size()
        self._data.resume(data["rng"], path, inner * accumulation, remapped)
        saved = data["progress"]
        progress.resume(position, saved["stopped"], saved["iters_done"])
        cut = progress.start_iter - saved["iters_done"]  # of a pass that max_iters ended early
        if progress.epoch_len is not None and not remapped and 0 < cut < progress.epoch_len:
            logger.warning(
                f"Checkpoint {path} ends a run whose max_iters ended its last pass after "
                f"{saved['iters_done']} iterations, {cut} before the pass's end: this run goes on "
                f"with the next pass, at iteration {progress.start_iter + 1}, without those {cut}."
            )

    def _read(self, path: str) -> dict[str, Any]:
        """The checkpoint at ``path``, in the format of what is there, if it can resume a run;
        else a RuntimeError naming ``path`` and the problem."""
        fmt = self._format(os.path.isdir(path))
        return fmt.read(path, lambda data: self._check(data, path))

    def _check(self, data: dict[str, Any], path: str) -> None:
        """Raise a RuntimeError naming ``path`` and the first problem unless ``data`` has the
        parts and types that loading uses, the registered things' tensors finite (the formats
        check the model's and the optimizer's)."""

        def damaged(why: str) -> RuntimeError:
            return RuntimeError(f"Checkpoint {path!r} is damaged: {why}.")

        missing = [key for key in _OWN_KEYS if key not in data]
        if missing:
            raise RuntimeError(f"Checkpoint {path!r} lacks {missing}: load it with resume=False.")
        # the trainer's parts hold dicts; a registered thing's state is whatever plain data its
        # state_dict() returned (a tuple, None), which load_state_dict() gets back as it was
        for key in (*_OWN_KEYS, *self._parts):
            kind = list if key == "rng" else dict
            if key in data and not isinstance(data[key], kind):
                raise damaged(f"{key!r} is of type {type(data[key]).__name__}, not {kind.__name__}")
        needed = {
            "progress": _PROGRESS_KEYS,
            "config": ("accumulation_steps", "amp", "classes"),
            "optimizer": ("state", "param_groups"),
        }
        for key, names in needed.items():
            lacking = [name for name in names if name not in data[key]]
            if lacking:
                raise damaged(f"{key!r} lacks {lacking[0]!r}")
        wrong = [k for k, v in data["model"].items() if not isinstance(v, torch.Tensor)]
        if wrong:
            raise damaged(f"'model' holds {len(wrong)} entries that are not tensors ({wrong[0]!r})")
        problem = _progress_problem(data["progress"])
        if problem:
            raise damaged(f"'progress' has {problem}")
        users = {name: data[name] for name in self._things.keys() - self._parts if name in data}
        refuse_non_finite(bad_tensors(users, ()), path)

    def _load_newest(self, candidates: list[str]) -> tuple[str, dict[str, Any]]:
        """The first of ``candidates`` (newest first) that loads and can resume a run, as ``(path,
        data)``; one that does not is skipped with a warning, and if none does, this raises."""
        failures = []
        for path in candidates:
            try:
                data = self._read(path)
            except (RuntimeError, OSError) as e:
                logger.warning(f"Skipping a checkpoint that does not load: {e}")
                failures.append(str(e))
                self._skipped.add(os.path.normpath(path))  # a save of its name says it replaces it
                continue
            if failures:
                logger.warning(f"Resuming from {path}, the newest checkpoint that loads.")
            return path, data
        raise RuntimeError(
            f"No checkpoint in {self.ckpt_dir} loads; train(auto_resume=False) starts afresh, "
            f"moving them into {PREVIOUS_RUNS}/:\n" + "\n".join(failures)
        )


# The folder's layout


def update_latest_pointer(ckpt_dir: str, file_name: str) -> None:
    """Point ``ckpt_dir/latest.txt`` at ``file_name``, atomically (works where symlinks do not)."""
    path = os.path.join(ckpt_dir, LATEST_POINTER)
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)  # damage in its place (an empty folder); a full one raises, named
    atomic_write(path, lambda f: f.write(file_name.encode()))


def written_by_trainer(file_name: str) -> bool:
    """Whether the trainer writes ``file_name`` (a path in ``ckpt_dir``) itself: a periodic
    checkpoint (``epoch_N.pth``, ``iter_N.pth``) or a file in one (a sharded checkpoint's
    folder), ``latest.txt`` (in each folder a checkpoint goes to), or a temporary name (ending
    in ``.tmp`` or ``.tmp.old``, the endings of the files that a start removes), or a file in
    ``previous/``, where a fresh start moves the earlier run's checkpoints."""
    parts = os.path.normpath(file_name).split(os.sep)
    temporary = any(part.endswith((TEMP_SUFFIX, ASIDE_SUFFIX)) for part in parts)
    ours = _PERIODIC.fullmatch(parts[0]) or parts[0] == PREVIOUS_RUNS
    return bool(ours) or LATEST_POINTER in parts or temporary


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
        logger.warning(f"{pointer} is damaged ({e}); using the newest checkpoint by age.")
        return None
    return os.path.join(ckpt_dir, name) if name else None


def list_checkpoints(ckpt_dir: str) -> list[str]:
    """The ``.pth`` entries in ``ckpt_dir``, newest first, ``latest.txt``'s leading (a dangling
    link stays: loading it fails with a reason worth a warning)."""
    found = glob.glob(os.path.join(glob.escape(ckpt_dir), "*.pth"))  # (a "[" in work_dir's name)
    paths = sorted(found, key=lambda p: (_mtime(p), p))[::-1]
    latest = read_latest_pointer(ckpt_dir)
    if latest in paths:
        paths.remove(latest)
        paths.insert(0, latest)
    return paths


def _new_folder(parent: str) -> str:
    """Make a new folder in ``parent``, named by the date and time (``2026-11-29_10-46-04``, or
    ``..._2`` after it), and return its path."""
    os.makedirs(parent, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    folder, n = os.path.join(parent, stamp), 1
    while True:
        try:
            os.mkdir(folder)
            return folder
        except FileExistsError:
            n += 1
            folder = os.path.join(parent, f"{stamp}_{n}")


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # a dangling link
        return 0.0


# What a loaded checkpoint must be


def _progress_problem(progress: dict[str, Any]) -> Optional[str]:
    """What is out of range in a checkpoint's ``progress``, or None: a wrong position would
    train from a negative iteration, or take an unfinished epoch for a finished one."""
    epoch_len = progress["epoch_len"]
    if epoch_len is not None and (not _is_int(epoch_len) or epoch_len < 1):
        return f"'epoch_len' = {epoch_len!r}, expected an int >= 1 or None"
    last_inner = epoch_len if epoch_len is not None else math.inf
    for key, upper in (("epoch", math.inf), ("inner_iter", last_inner), ("iters_done", math.inf)):
        value = progress[key]
        if not _is_int(value) or not 0 <= value <= upper:
            expected = "an int >= 0" if upper == math.inf else f"an int from 0 to {upper}"
            return f"{key!r} = {value!r}, expected {expected}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_config(saved: dict[str, Any], now: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint whose ``accumulation_steps`` (the data position would not map) or
    optimizer classes differ; warn about a changed AMP setting (training goes on, not bit for
    bit)."""
    steps = saved["accumulation_steps"]
    if steps != now["accumulation_steps"]:
        raise ValueError(
            f"Checkpoint {path!r} was trained with accumulation_steps={steps}: resume with it."
        )
    for key, saved_class in saved["classes"].items():
        now_class = now["classes"].get(key, saved_class)
        if now_class != saved_class:
            raise ValueError(
                f"Checkpoint {path!r} holds {saved_class} state for {key}, not {now_class}: "
                f"resume with {saved_class}, or load the weights alone (resume=False)."
            )
    if saved["amp"] != now["amp"]:
        logger.warning(
            f"Checkpoint {path} was trained with AMP {saved['amp']}, this run uses AMP "
            f"{now['amp']}: training goes on, but not bit for bit as the original run would."
        )
