"""Checkpoints: what they hold (:class:`Checkpointer` gathers and restores the trainer's state)
and their names. Writing the files is ``checkpoint_files.py``'s, loading them
``checkpoint_load.py``'s."""

import glob
import logging
import os
from typing import Any, Callable, Optional, Sequence

from torch import nn
from torch.optim import Optimizer

from .checkpoint_files import (
    BackgroundWriter,
    UnloadableState,
    bad_tensors,
    check_plain,
    copy_to_cpu,
    describe,
    format_path,
    remove_temp_files,
    save_in_background,
)
from .distributed import CpuGroup, all_gather, gather, get_world_size, is_main_process
from .fsdp import full_state_dicts, is_sharded
from .progress import DataStream, Progress
from .step import unwrapped

logger = logging.getLogger(__name__)


class Checkpointer:
    """Gathers the trainer's whole state into checkpoints and restores it.

    A checkpoint is a dict of tensors and plain data (it loads with ``weights_only=True``):
    ``model`` (the unwrapped module's weights), ``optimizer``, the ``parts``, ``hooks``,
    ``extra`` (what :meth:`register` added), ``rng`` (per rank), ``progress`` and ``config``.

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
        cpu: The trainer's gloo group, for the gathers of a save while it trains.
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
        cpu: Optional[CpuGroup] = None,
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
        self._cpu = cpu or CpuGroup()
        self._extra: dict[str, Any] = {}
        self.last_path: Optional[str] = None  # the checkpoint saved (rank 0) or loaded last
        self._sharded = is_sharded(model)  # by FSDP2's fully_shard
        self.writer = BackgroundWriter()  # its ``failed`` flag is read every iteration

    @property
    def _module(self) -> nn.Module:
        return unwrapped(self._model)

    @property
    def optimizers(self) -> list[Optimizer]:
        """The trainer's optimizer and the registered ones."""
        extra = [obj for obj in self._extra.values() if isinstance(obj, Optimizer)]
        return [self._optimizer, *extra]

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
        """Save the whole state as ``ckpt_dir/file_name`` and point ``latest.txt`` at it.

        Training waits only while the state is copied to CPU memory; rank 0 writes the file in
        the background, atomically, and calls ``then()`` once it is durable. The next save,
        :meth:`wait` and the end of ``train()`` raise a failed write's ``OSError``. Every rank
        calls this, and gets the path being written (None on other ranks).
        """
        state = self._live_state()
        self._refuse_unloadable(file_name, state)
        self._progress.mark_saved()
        # FSDP2: every rank takes part in gathering the full weights, which rank 0 writes.
        weights = full_state_dicts(self._model, self._optimizer) if self._sharded else None
        # Per-rank RNG, so every rank's dropout and data-worker seeds resume exactly.
        rng = gather(
            self._data.rng_state(mid_pass=self._progress.position[1] > 0), group=self._cpu.group
        )
        if not is_main_process():
            return None
        path = os.path.join(self.ckpt_dir, file_name)
        if weights is not None:  # gathered into fresh CPU tensors already: no second copy
            del state["model"], state["optimizer"]

        def copy() -> dict[str, Any]:
            copied = copy_to_cpu({**state, "rng": rng})
            if weights is not None:
                copied["model"], copied["optimizer"] = weights
            return copied

        save_in_background(self.writer, copy, path, then)
        self.last_path = path
        logger.info(f"Saving checkpoint {path} (after iteration {self._progress.iter + 1}).")
        return path

    def _live_state(self) -> dict[str, Any]:
        """Every part's ``state_dict()``, as the parts return it (tensors on their devices)."""
        return {
            "progress": self._progress.state_dict(self._batch_size),
            "config": self.config(),
            "model": self._module.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            **{key: part.state_dict() for key, part in self._parts.items()},
            "hooks": {key: hook.state_dict() for key, hook in self._hooks().items()},
            "extra": {name: obj.state_dict() for name, obj in self._extra.items()},
        }

    def _refuse_unloadable(self, file_name: str, state: dict[str, Any]) -> None:
        """Refuse a state that no resume could use: tensors not finite (it would become `latest`
        and make every rerun fail alike), or values that ``weights_only`` loads cannot rebuild.
        Under torchrun every rank raises alike (with rank 0's last write failure, if any)."""
        bad = bad_tensors({**state, "optimizer": state["optimizer"]["state"]}, self.parameters())
        try:
            check_plain(state)
            unloadable = None
        except UnloadableState as e:
            unloadable = _unloadable_message(file_name, e)
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

    def raise_write_error(self) -> None:
        """Raise the failed write's ``OSError`` on rank 0, elsewhere an error pointing at it."""
        self.writer.wait()
        raise RuntimeError(
            "Rank 0 could not write a checkpoint (its log names the file and the reason); "
            f"every rank stops after iteration {self._progress.iter + 1}."
        )

    def remove_temp_files(self) -> None:
        """On rank 0, delete what writes interrupted by a crash left behind."""
        if is_main_process():
            for stray in remove_temp_files(self.ckpt_dir):
                logger.info(f"Removed {stray}, left by an interrupted checkpoint write.")

    def parameters(self) -> set[str]:
        """The names of the model's parameters in its ``state_dict`` (a tied weight's every
        name), which must be finite."""
        return {name for name, _ in self._module.named_parameters(remove_duplicate=False)}

    def config(self) -> dict[str, Any]:
        """The ``config`` a checkpoint holds, with the optimizers' classes (a state does not
        fit another class)."""
        objects = {
            "optimizer": self._optimizer,
            **{f"extra.{n}": o for n, o in self._extra.items()},
        }
        classes = {key: type(obj).__name__ for key, obj in objects.items()}
        return {**self._config, "classes": classes}

    def load(
        self,
        path: Optional[str],
        auto_resume: bool,
        resume: bool,
        strict: bool,
        revise_keys: Optional[Sequence[tuple[str, str]]] = None,
    ) -> bool:
        """Load a checkpoint: the whole training state, or only the model's weights; whether
        one was loaded. See :func:`trainer.checkpoint_load.load` for the arguments."""
        if revise_keys is not None:
            from .checkpoint_load import check_revise_keys

            check_revise_keys(revise_keys, resume)
        if path is None and not auto_resume:
            raise ValueError("Pass a checkpoint path, or auto_resume=True to use the latest.")
        self.wait()  # a write in flight may be the newest checkpoint
        if path is None and not glob.glob(os.path.join(self.ckpt_dir, "*.pth")):
            logger.debug(f"No checkpoint in {self.ckpt_dir}: training from scratch.")
            return False  # a fresh run: the loading code is not even imported
        from .checkpoint_load import load

        return load(self, path, resume, strict, revise_keys)


def checkpoint_name(by_epoch: bool, position: tuple[int, int], iters_done: int) -> str:
    """The file name of a checkpoint taken at ``position`` (epoch, iterations done in it):
    ``epoch_{N}.pth`` at an epoch's end in epoch-based training, otherwise ``iter_{N}.pth``."""
    epoch, inner = position
    return f"epoch_{epoch}.pth" if by_epoch and inner == 0 else f"iter_{iters_done}.pth"


# The owners of a checkpoint's top-level keys, as a message names them.
_OWNERS = {
    "model": "the model", "optimizer": "the optimizer", "lr_scheduler": "the LR scheduler",
    "grad_scaler": "the GradScaler", "metric_storage": "the metric storage",
}  # fmt: skip


def _unloadable_message(file_name: str, error: UnloadableState) -> str:
    """Why a state cannot be saved: whose ``state_dict()`` holds what, where, and the fix."""
    top, *rest = error.path or ("?",)
    if top in ("hooks", "extra") and rest:
        kind = "hook" if top == "hooks" else "checkpointable"
        owner, rest = f"{kind} {rest[0]!r}", rest[1:]
    else:
        owner = _OWNERS.get(top, f"the trainer's {top!r}")
    return (
        f"Not saving {file_name}: the state_dict() of {owner} holds {describe(error.value)} at "
        f"state_dict(){format_path(tuple(rest))}, which torch.load(weights_only=True) cannot "
        "rebuild, so no run could resume from this checkpoint. Return plain data from "
        "state_dict() (dicts, lists, tuples, str, numbers, None, tensors) and rebuild the "
        "object in load_state_dict(): e.g. dict(x) for a defaultdict, tuple(x) or x._asdict() "
        "for a namedtuple, x.tolist() or torch.from_numpy(x) for a NumPy array, float(x) for a "
        "NumPy float32, x.as_subclass(torch.Tensor) for a tensor subclass."
    )
