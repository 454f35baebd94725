"""Checkpoints: what they hold (:class:`Checkpointer` gathers the trainer's whole state and puts
it back), every name and the layout of ``work_dir/checkpoints`` (``epoch_N.pth``, ``iter_N.pth``,
``latest.txt``, and the temporary and set-aside names of writes in flight), and finding the
newest checkpoint that loads. The bytes on disk are ``checkpoint_io.py``'s; the sharded format of
FSDP2 models is ``sharded_checkpoint.py``'s, imported by the runs that use it."""

import contextlib
import glob
import logging
import math
import os
import threading
from collections.abc import Iterator
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from .checkpoint_io import (
    TEMP_SUFFIX,
    BackgroundWriter,
    UnloadableState,
    atomic_save,
    bad_tensors,
    check_finite,
    check_plain,
    check_rank_state,
    check_revise_keys,
    copy_to_cpu,
    current_umask,
    fsync_folder,
    load_checkpoint_file,
    load_model_state,
    load_optimizer_state,
    model_weights,
    remove_checkpoint,
    revised,
    write_checkpoint_file,
)
from .data import DataStream
from .distributed import CpuGroup, all_gather, gather, get_world_size, is_main_process, is_sharded
from .fsdp import full_state_dicts
from .misc import check_file_name, plain_names, plain_state_dict, unwrapped
from .progress import Progress, map_position

logger = logging.getLogger(__name__)

LATEST_POINTER = "latest.txt"  # names the newest checkpoint of its folder
ASIDE_SUFFIX = ".old"  # after TEMP_SUFFIX: a checkpoint moved aside while one replaces it
# What a checkpoint needs to resume a run (a weights-only load needs "model" alone).
RESUME_KEYS = ("progress", "config", "model", "optimizer", "lr_scheduler", "grad_scaler",
               "metric_storage", "hooks", "extra", "rng")  # fmt: skip
# What each part of a checkpoint must be: its type, and for dicts the keys it must have.
_STRUCTURE: dict[str, tuple[type, tuple[str, ...]]] = {
    "model": (dict, ()),
    "optimizer": (dict, ("state", "param_groups")),
    "progress": (dict, ("epoch", "inner_iter", "epoch_len", "iters_done", "world_size",
                        "batch_size", "stopped")),
    "config": (dict, ("accumulation_steps", "amp", "classes")),
    "lr_scheduler": (dict, ()),
    "grad_scaler": (dict, ()),
    "metric_storage": (dict, ()),
    "hooks": (dict, ()),
    "extra": (dict, ()),
    "rng": (list, ()),
}  # fmt: skip
# The owners of a checkpoint's top-level keys, as a message names them.
_OWNERS = {
    "model": "the model", "optimizer": "the optimizer", "lr_scheduler": "the LR scheduler",
    "grad_scaler": "the GradScaler", "metric_storage": "the metric storage",
}  # fmt: skip


def _dcp() -> Any:
    """``trainer.sharded_checkpoint``, imported by the runs that save or load a sharded
    checkpoint: it imports torch.distributed.checkpoint, which takes most of a second."""
    from . import sharded_checkpoint  # heavy and optional: DCP

    return sharded_checkpoint


class Checkpointer:
    """Gathers the trainer's whole state into checkpoints and restores it (``trainer.checkpointer``;
    ``trainer.save_checkpoint`` first flushes the metrics and tells the hooks). What a checkpoint
    holds: docs/checkpoints.md. ``cpu`` is the trainer's gloo group."""

    def __init__(
        self,
        ckpt_dir: str,
        model: nn.Module,
        optimizer: Optimizer,
        progress: Progress,
        data: DataStream,
        cpu: CpuGroup,
        *,
        parts: dict[str, Any],
        hooks: Callable[[], dict[str, Any]],
        config: dict[str, Any],
        by_epoch: bool = True,
    ) -> None:
        self.ckpt_dir = ckpt_dir  # where the checkpoints and latest.txt are
        self._model = model
        self._module = unwrapped(model)  # whose weights checkpoints hold
        self._optimizer = optimizer
        self._progress = progress
        self._data = data
        self._batch_size = getattr(data.data_loader, "batch_size", None)  # per process
        self._cpu = cpu
        self._parts = parts
        self._hooks = hooks
        self._config = config
        self._by_epoch = by_epoch
        self._extra: dict[str, Any] = {}
        self.last_path: Optional[str] = None
        """The newest checkpoint on disk: the one loaded, or saved (on rank 0) once its write is
        complete; never one still being written."""
        self._writing: Optional[str] = None  # the checkpoint being written (rank 0)
        self._publishing = threading.Lock()  # held while a write takes its name: see held()
        self._model_sharded = is_sharded(model)  # by FSDP2's fully_shard
        self._buffers_warned = False  # that an FSDP2 model's buffers differ by rank
        self.sharded = self._model_sharded
        """Save sharded checkpoints, a folder of every rank's shards (``sharded_checkpoint.py``):
        the default for FSDP2 models. False: one file of the full state."""
        self.writer = BackgroundWriter()
        self._write_group: Any = None  # sharded saves' gloo group, while train() runs

    @property
    def optimizers(self) -> list[Optimizer]:
        """The trainer's optimizer and the registered ones."""
        extra = [obj for obj in self._extra.values() if isinstance(obj, Optimizer)]
        return [self._optimizer, *extra]

    def name_of(self, obj: Any) -> str:
        """The name ``obj`` was registered with; a ValueError if it was not."""
        for name, registered in self._extra.items():
            if registered is obj:
                return name
        raise ValueError(
            f"This {type(obj).__name__} is not the trainer's and not registered with "
            "trainer.checkpointer.register(name, obj), so no checkpoint holds its state and a "
            "resume would not be exact; register it once, where you create it (as "
            "docs/loop.md's GAN does with its second optimizer)."
        )

    def name(self) -> str:
        """The file name of a checkpoint taken now: ``epoch_{N}.pth`` at an epoch's end in
        epoch-based training, ``iter_{N}.pth`` otherwise (N epochs or iterations done)."""
        epoch, inner = self._progress.position
        if self._by_epoch and inner == 0:
            return f"epoch_{epoch}.pth"
        return f"iter_{self._progress.iter + 1}.pth"

    def path(self, file_name: str) -> str:
        """Where the checkpoint ``file_name`` is: in :attr:`ckpt_dir` (a name leading out of it
        is refused)."""
        check_file_name("file_name", file_name)
        return os.path.join(self.ckpt_dir, file_name)

    def register(self, name: str, obj: Any) -> None:
        """Save ``obj.state_dict()`` under ``extra[name]`` in every checkpoint and restore it on
        resume: an extra optimizer, scheduler or module that an overridden step uses."""
        if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(
                f"checkpointer.register({name!r}, ...) needs an object with state_dict() and "
                f"load_state_dict() (an optimizer, scheduler or module), got {type(obj).__name__}."
            )
        if name in self._extra:
            raise ValueError(f"A checkpointable named {name!r} is registered already.")
        self._extra[name] = obj

    # Saving

    def save(self, file_name: str, then: Optional[Callable[[], None]] = None) -> Optional[str]:
        """Save the whole state as ``ckpt_dir/file_name`` and point ``latest.txt`` at it.

        Training waits only while the state is copied to CPU memory; rank 0 writes the file (or,
        :attr:`sharded`, every rank its shards) in the background, atomically, and calls
        ``then()`` once it is durable. The next save, :meth:`wait` and the end of ``train()``
        raise a failed write's ``OSError``. Every rank calls this; rank 0 gets the path (other
        ranks None).
        """
        path = self.path(file_name)
        state = self._live_state()
        # per rank, so that every rank's dropout and data-worker seeds resume exactly
        own_rng = self._data.rng_state(mid_pass=self._progress.position[1] > 0)
        self._refuse_unloadable(file_name, {**state, "rng": [own_rng]})
        if self._model_sharded:  # what one copy keeps for every rank must be the same
            warn = not self._buffers_warned
            self._buffers_warned |= check_rank_state(state, self._cpu.group, check_buffers=warn)
        self._progress.mark_saved()
        if self.sharded:  # every rank writes its shards
            self._save_sharded(state, own_rng, path, then)
        else:
            self._save_file(state, own_rng, path, then)
        if not is_main_process():
            return None
        # written in the background: a line says when it is on disk
        done = self._progress.iter + 1
        logger.info(f"Writing checkpoint {path} (after iteration {done}) in the background.")
        return path

    def _save_file(
        self, state: dict[str, Any], own_rng: Any, path: str, then: Optional[Callable[[], None]]
    ) -> None:
        """Save one file of the whole (full) state: rank 0 writes it."""
        weights = None
        if self._model_sharded:  # FSDP2: every rank gathers the full states; rank 0 writes
            weights = full_state_dicts(self._model, self._optimizer)
        rng = gather(own_rng, group=self._cpu.group)
        if not is_main_process():
            return
        if weights is not None:  # gathered into fresh CPU tensors already: no second copy
            del state["model"], state["optimizer"]
        self.writer.wait()  # one copy in memory at a time; raises if the last write failed
        copied = copy_to_cpu({**state, "rng": rng})  # training goes on, changing `state`
        if weights is not None:
            copied["model"], copied["optimizer"] = weights
        mode = 0o666 & ~current_umask()  # read here, in the training thread
        folder, name = os.path.split(path)  # a file in a sub-folder gets a latest.txt there
        aside = _aside(path)
        if os.path.isdir(path) and not os.path.islink(path):  # a sharded checkpoint's name
            os.replace(path, aside)  # (put back at the next start if the file never comes)

        def write() -> None:
            atomic_save(copied, path, mode)
            if os.path.lexists(aside):
                remove_checkpoint(aside)
            self._publish(folder, name, mode, path)
            if then is not None:
                then()

        self._writing = path
        self.writer.submit(write)

    def _save_sharded(
        self, state: dict[str, Any], own_rng: Any, path: str, then: Optional[Callable[[], None]]
    ) -> None:
        """Save a sharded checkpoint, a folder: every rank writes its shards under a temporary
        name, and rank 0 the rest of the state; the folder takes its name once complete."""
        rng = gather(own_rng, group=self._cpu.group)
        self.writer.wait()  # the last save's files are complete; raises if its write failed
        mode = 0o666 & ~current_umask()  # read here, in the training thread
        rest = None
        if is_main_process():
            rest = {key: value for key, value in state.items() if key not in ("model", "optimizer")}
            rest = copy_to_cpu({**rest, "rng": rng})
        folder, name = os.path.split(path)
        temp = os.path.join(folder, f".{name}{TEMP_SUFFIX}")
        if is_main_process():
            self._writing = path

        def publish() -> None:  # on rank 0, once every rank's files are complete
            _replace_folder(temp, path)
            self._publish(folder, name, mode, path)

        _dcp().save(
            self._module, self._optimizer, rest, temp, mode=mode,
            group=self._write_group, writer=self.writer, publish=publish, then=then,
        )  # fmt: skip

    def _publish(self, folder: str, name: str, mode: int, path: str) -> None:
        """Point ``latest.txt`` at the complete checkpoint ``path``, which becomes
        :attr:`last_path` (in the writer's thread, on rank 0)."""
        with self._publishing:
            update_latest_pointer(folder, name, mode)
            self.last_path, self._writing = path, None
        logger.info(f"Saved checkpoint {path} (on disk).")

    @contextlib.contextmanager
    def held(self) -> Iterator[tuple[Optional[str], Optional[str]]]:
        """Yield :attr:`last_path` (on disk) and the checkpoint being written (None when no write
        is in flight), which stay so while the block runs: no write takes its name meanwhile, so
        a message can name them and the process exit in the block (a second Ctrl-C does)."""
        with self._publishing:
            yield self.last_path, None if self.writer.failed else self._writing

    def _live_state(self) -> dict[str, Any]:
        """Every part's ``state_dict()``, tensors on their devices."""
        return {
            "progress": self._progress.state_dict(self._batch_size),
            "config": self.config(),
            "model": plain_state_dict(self._module),
            "optimizer": self._optimizer.state_dict(),
            **{key: part.state_dict() for key, part in self._parts.items()},
            "hooks": {key: hook.state_dict() for key, hook in self._hooks().items()},
            "extra": {name: obj.state_dict() for name, obj in self._extra.items()},
        }

    def _refuse_unloadable(self, file_name: str, state: dict[str, Any]) -> None:
        """Refuse a state no resume could use: tensors not finite (as `latest` it would fail
        every rerun alike), or values ``weights_only`` loads cannot rebuild. Ranks agree."""
        optimizer = state["optimizer"]["state"]
        bad = bad_tensors({**state, "optimizer": optimizer}, self.parameters())
        unloadable = None  # the message, which the ranks share
        try:
            check_plain(state)
        except UnloadableState as e:
            top, *rest = e.path or ("?",)
            if top in ("hooks", "extra") and rest:
                kind = "hook" if top == "hooks" else "checkpointable"
                owner, rest = f"{kind} {rest[0]!r}", rest[1:]
            elif top == "rng" and rest[1:2] == ["loader"]:  # a stateful data loader's own state
                owner, rest = "the data loader", rest[2:]
            else:
                owner = _OWNERS.get(top, f"the trainer's {top!r}")
            value = type(e.value)
            module = "" if value.__module__ == "builtins" else value.__module__.split(".")[0] + "."
            where = "".join(f"[{key!r}]" for key in rest) or "the top"
            unloadable = (
                f"Not saving {file_name}: the state_dict() of {owner} holds a {module}"
                f"{value.__qualname__} at state_dict(){where}, which torch.load(weights_only=True) "
                "cannot rebuild, so no run could resume from this checkpoint. Return plain data "
                "from state_dict() (dicts, lists, tuples, str, numbers, None, tensors) and rebuild "
                "the object in load_state_dict(): e.g. dict(x) for a defaultdict, tuple(x) or "
                "x._asdict() for a namedtuple, x.tolist() or torch.from_numpy(x) for a NumPy "
                "array, float(x) for a NumPy float32, x.as_subclass(torch.Tensor) for a tensor "
                "subclass."
            )
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
                f"Not saving {file_name}: after iteration {self._progress.iter + 1}, "
                f"{len(bad)} tensors hold NaN or infinite values ({', '.join(bad[:5])}"
                f"{', ...' if len(bad) > 5 else ''}). The latest checkpoint is still the last "
                "good one. Lower the LR, enable clip_grad_norm, or check the data and the loss "
                "of the last iterations (a NaN gradient can come with a finite loss)."
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
        raise RuntimeError(
            f"{'A rank' if self.sharded else 'Rank 0'} could not write a checkpoint (its log "
            "names the file and the reason); "
            f"every rank stops after iteration {self._progress.iter + 1}."
        )

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """What ``train()`` holds for the saves: the gloo group of the background writes of
        sharded checkpoints, under torchrun."""
        if not self.sharded:
            yield
            return
        with _dcp().write_group() as self._write_group:
            try:
                yield
            finally:
                self._write_group = None

    def remove_temp_files(self) -> None:
        """On rank 0, clear what writes interrupted by a crash left behind: a file or folder
        being written is deleted; a checkpoint moved aside to be replaced is put back if its
        replacement never took its name (every rank calls it, and waits for it)."""
        if is_main_process():
            pattern = os.path.join(glob.escape(self.ckpt_dir), f".*{TEMP_SUFFIX}")
            for stray in glob.glob(pattern) + glob.glob(pattern + ASIDE_SUFFIX):
                original = _set_aside_from(stray)
                if original is not None and not os.path.lexists(original):
                    os.replace(stray, original)
                    logger.info(
                        f"Restored {original}, moved aside by an interrupted checkpoint write."
                    )
                    continue
                remove_checkpoint(stray)
                logger.info(f"Removed {stray}, left by an interrupted checkpoint write.")
        all_gather("cleaned up", group=self._cpu.group)  # the others then list checkpoints

    def parameters(self) -> set[str]:
        """The names of the model's parameters in a checkpoint (a tied weight's every one)."""
        names = [name for name, _ in self._module.named_parameters(remove_duplicate=False)]
        return set(plain_names(self._module, names).values())

    def config(self) -> dict[str, Any]:
        """The ``config`` a checkpoint holds, with the optimizers' classes (a state does not
        fit another class)."""
        classes = {f"extra.{name}": type(obj).__name__ for name, obj in self._extra.items()}
        return {**self._config, "classes": {"optimizer": type(self._optimizer).__name__, **classes}}

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
                metrics, hooks, registered extras) to continue the run exactly. False loads the
                model's weights only, for fine-tuning or evaluation, from a trainer checkpoint
                or any file of weights: a ``state_dict``, or a dict holding one under
                ``"state_dict"`` or ``"model"``.
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
        candidates = list_checkpoints(self.ckpt_dir) if path is None else []
        if path is None and not candidates:
            logger.debug(f"No checkpoint in {self.ckpt_dir}: training from scratch.")
            return False
        auto_picked = path is None
        if path is None:
            path, data = self._load_newest(candidates)
            weights = data["model"]
        elif resume:
            data = self._read_resumable(path)
            weights = data["model"]
        else:
            weights = model_weights(self._read_weights(path), path)
        weights = revised(weights, revise_keys or (), path)
        if not resume and not auto_picked:  # _load_newest checked the one it picked
            check_finite({"model": weights}, path, self.parameters())
        load_model_state(self._module, weights, path, strict, self._model_sharded)
        if not resume:
            logger.info(f"Loaded model weights from {path}; the training state is not restored.")
            return True
        self._load_state(data, path)
        self.last_path = path
        done = self._progress.resumed_iters  # the checkpoint's, which max_iters may cut
        logger.info(f"Resumed from checkpoint {path} after iteration {done}.")
        return True

    def _load_state(self, data: dict[str, Any], path: str) -> None:
        """Put back the training state besides the model's weights."""
        _check_config(data["config"], self.config(), path)
        progress, accumulation = self._progress, self._config["accumulation_steps"]
        position = map_position(
            data["progress"], path, progress.epoch_len, self._batch_size, accumulation
        )
        load_optimizer_state(
            self._module, self._optimizer, data["optimizer"], path, self._model_sharded
        )
        for key, part in self._parts.items():
            part.load_state_dict(data[key])
        for kind, owners, states in (
            ("hook", self._hooks(), data["hooks"]),
            ("checkpointable", self._extra, data["extra"]),
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
        mid_pass = progress.epoch_len is None or inner < progress.epoch_len
        remapped = inner != data["progress"]["inner_iter"] or len(data["rng"]) != get_world_size()
        self._data.resume(data["rng"], path, inner * accumulation if mid_pass else 0, remapped)
        saved = data["progress"]
        progress.resume(position, saved["stopped"], saved["iters_done"])
        cut = progress.start_iter - saved["iters_done"]  # of a pass that max_iters ended early
        if progress.epoch_len is not None and not remapped and 0 < cut < progress.epoch_len:
            logger.warning(
                f"Checkpoint {path} ends a run whose max_iters ended its last pass after "
                f"{saved['iters_done']} iterations, {cut} before the pass's end: this run goes on "
                f"with the next pass, at iteration {progress.start_iter + 1}, without those {cut}."
            )

    def _read_weights(self, path: str) -> dict[str, Any]:
        """A checkpoint file as it is, or of a sharded checkpoint's folder the model's full
        weights alone (``{"model": ...}``)."""
        if os.path.isdir(path) and _dcp().is_sharded_checkpoint(path):
            return {"model": _dcp().read_weights(path)}
        return load_checkpoint_file(path, need_checksum=False)  # weights from anywhere

    def _read_resumable(self, path: str) -> dict[str, Any]:
        """The checkpoint at ``path``, if it can resume a run: every part there, of the types
        that loading uses, its tensors finite; else a RuntimeError naming ``path`` and the
        problem."""

        def check(data: dict[str, Any]) -> None:
            _check_keys(data, path, RESUME_KEYS)
            _check_structure(data, path, RESUME_KEYS)
            if not sharded:  # (a sharded checkpoint's tensors are checked on every rank alike)
                check_finite(data, path, self.parameters())

        sharded = os.path.isdir(path)
        if not sharded:  # checked while its checksum is
            return load_checkpoint_file(path, check=check)
        # a sharded checkpoint's folder (or an error naming what it is)
        data = _dcp().read_resumable(
            path, self._module, self._optimizer, self._cpu.group, self.parameters()
        )
        check(data)
        return data

    def _load_newest(self, candidates: list[str]) -> tuple[str, dict[str, Any]]:
        """The first of ``candidates`` (newest first) that loads and can resume a run, as ``(path,
        data)``; one that does not is skipped with a warning, and if none does, this raises."""
        failures = []
        for path in candidates:
            try:
                data = self._read_resumable(path)
            except (RuntimeError, OSError) as e:
                logger.warning(f"Skipping a checkpoint that does not load: {e}")
                failures.append(str(e))
                continue
            if failures:
                logger.warning(f"Resuming from {path}, the newest checkpoint that loads.")
            return path, data
        raise RuntimeError(
            f"None of the {len(failures)} checkpoints in {self.ckpt_dir} loads:\n"
            + "\n".join(failures)
            + "\nMove them out of the folder to start afresh, or pass "
            "resume_from_checkpoint= a good file."
        )


# The folder's layout


def update_latest_pointer(ckpt_dir: str, file_name: str, mode: Optional[int] = None) -> None:
    """Point ``ckpt_dir/latest.txt`` at ``file_name``, atomically (works where symlinks do not)."""
    path = os.path.join(ckpt_dir, LATEST_POINTER)
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)  # damage in its place (an empty folder); a full one raises, named
    write_checkpoint_file(path, lambda f: f.write(file_name.encode()), mode)


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
    """The ``.pth`` entries in ``ckpt_dir``, newest first, ``latest.txt``'s leading (a dangling
    link stays: loading it fails with a reason worth a warning)."""
    found = glob.glob(os.path.join(glob.escape(ckpt_dir), "*.pth"))  # (a "[" in work_dir's name)
    paths = sorted(found, key=lambda p: (_mtime(p), p))[::-1]
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


def _aside(path: str) -> str:
    """Where a checkpoint at ``path`` waits while a new one of its name replaces it: put back
    at the next start if a crash comes first (:meth:`Checkpointer.remove_temp_files`)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TEMP_SUFFIX}{ASIDE_SUFFIX}")


def _set_aside_from(path: str) -> Optional[str]:
    """The checkpoint that :func:`_aside` named ``path``, or None if it names no such thing."""
    base, suffix = os.path.basename(path), TEMP_SUFFIX + ASIDE_SUFFIX
    if not base.endswith(suffix):
        return None
    return os.path.join(os.path.dirname(path), base[1 : -len(suffix)])


def _replace_folder(temp: str, path: str) -> None:
    """Rename the complete folder ``temp`` to ``path``, durably. A checkpoint of that name is
    moved aside first (:func:`_aside`): a crash between the two renames leaves it there, and
    the next start puts it back."""
    old = _aside(path) if os.path.lexists(path) else None
    if old is not None:
        os.replace(path, old)
    os.replace(temp, path)
    fsync_folder(os.path.dirname(path))
    if old is not None:
        remove_checkpoint(old)


# What a loaded checkpoint must be


def _check_keys(data: dict[str, Any], path: str, keys: tuple[str, ...]) -> None:
    """Raise a RuntimeError naming ``path`` when ``data`` lacks any of ``keys``."""
    missing = [k for k in keys if k not in data]
    if missing:
        raise RuntimeError(
            f"Checkpoint {path!r} lacks {missing}: it was not written by trainer.save_checkpoint. "
            "For weights alone, use load_checkpoint(path, resume=False)."
        )


def _check_structure(data: dict[str, Any], path: str, keys: tuple[str, ...]) -> None:
    """Raise a RuntimeError naming ``path`` and the first problem when the parts ``keys`` of a
    checkpoint do not have the types and keys that loading them uses."""

    def damaged(reason: str) -> RuntimeError:
        return RuntimeError(f"Checkpoint {path!r} is damaged: {reason}.")

    for key in keys:
        kind, required = _STRUCTURE[key]
        value = data[key]
        if not isinstance(value, kind):
            raise damaged(f"{key!r} is of type {type(value).__name__}, expected {kind.__name__}")
        for name in required:
            if name not in value:
                raise damaged(f"{key!r} lacks {name!r}")
    if "config" in keys and not isinstance(data["config"]["classes"], dict):
        raise damaged(
            f"'config' holds 'classes' of type {type(data['config']['classes']).__name__}"
        )
    if "model" in keys:
        wrong = [k for k, v in data["model"].items() if not isinstance(v, torch.Tensor)]
        if wrong:
            raise damaged(f"'model' holds {len(wrong)} entries that are not tensors ({wrong[0]!r})")
    if "progress" in keys:
        problem = _progress_problem(data["progress"])
        if problem:
            raise damaged(f"'progress' has {problem}")
    if "rng" in keys and not (
        data["rng"] and all(isinstance(r, dict) and "now" in r for r in data["rng"])
    ):
        raise damaged("'rng' is not a list of per-rank RNG states")


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
    if saved["accumulation_steps"] != now["accumulation_steps"]:
        raise ValueError(
            f"Checkpoint {path!r} was trained with accumulation_steps="
            f"{saved['accumulation_steps']}, this trainer has {now['accumulation_steps']}; "
            "the data position cannot be mapped. Resume with the same accumulation_steps."
        )
    for key, saved_class in saved["classes"].items():
        now_class = now["classes"].get(key, saved_class)
        if now_class != saved_class:
            raise ValueError(
                f"Checkpoint {path!r} holds the state of a {saved_class} for {key}, and this "
                f"trainer's {key} is a {now_class}: that state does not fit it. Resume with a "
                f"{saved_class}, or start the new optimizer from the checkpoint's weights alone: "
                "trainer.load_checkpoint(path, resume=False), then train(auto_resume=False) in "
                "a new work_dir."
            )
    if saved["amp"] != now["amp"]:
        logger.warning(
            f"Checkpoint {path} was trained with AMP {saved['amp']}, this run uses AMP "
            f"{now['amp']}: training goes on, but not bit for bit as the original run would."
        )
