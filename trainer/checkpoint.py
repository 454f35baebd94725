"""Checkpoints: what they hold (:class:`Checkpointer` gathers and restores the trainer's state)
and their names. Writing files is ``checkpoint_files.py``'s, loading ``checkpoint_load.py``'s."""

import glob
import logging
import os
from typing import Any, Callable, Optional, Sequence

from torch import nn
from torch.optim import Optimizer

from . import checkpoint_files as files
from .distributed import CpuGroup, all_gather, gather, get_world_size, is_main_process, is_sharded
from .misc import unwrapped
from .progress import DataStream, Progress

logger = logging.getLogger(__name__)


class Checkpointer:
    """Gathers the trainer's whole state into checkpoints and restores it (``trainer.checkpointer``;
    ``trainer.save_checkpoint`` first flushes the metrics and tells the hooks). What a checkpoint
    holds: docs/checkpoints.md. ``batch_size`` is per process; ``cpu`` the trainer's gloo group."""

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
        by_epoch: bool = True,
    ) -> None:
        self.ckpt_dir = ckpt_dir
        self._model = model
        self._module = unwrapped(model)  # whose weights checkpoints hold
        self._optimizer = optimizer
        self._progress = progress
        self._data = data
        self._parts = parts
        self._hooks = hooks
        self._config = config
        self._batch_size = batch_size
        self._cpu = cpu or CpuGroup()
        self._extra: dict[str, Any] = {}
        self._by_epoch = by_epoch
        self.last_path: Optional[str] = None  # the checkpoint saved (rank 0) or loaded last
        self._model_sharded = is_sharded(model)  # by FSDP2's fully_shard
        self.sharded = self._model_sharded
        """Save sharded checkpoints, a folder of every rank's shards (``sharded_checkpoint.py``):
        the default for FSDP2 models. False: one file of the full state."""
        self.writer = files.BackgroundWriter()
        self._write_group: Any = None  # sharded saves' gloo group, while train() runs

    @property
    def optimizers(self) -> list[Optimizer]:
        """The trainer's optimizer and the registered ones."""
        extra = [obj for obj in self._extra.values() if isinstance(obj, Optimizer)]
        return [self._optimizer, *extra]

    def name(self) -> str:
        """The file name of a checkpoint taken now: ``epoch_{N}.pth`` at an epoch's end in
        epoch-based training, ``iter_{N}.pth`` otherwise (N epochs or iterations done)."""
        epoch, inner = self._progress.position
        if self._by_epoch and inner == 0:
            return f"epoch_{epoch}.pth"
        return f"iter_{self._progress.iter + 1}.pth"

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

    def save(self, file_name: str, then: Optional[Callable[[], None]] = None) -> Optional[str]:
        """Save the whole state as ``ckpt_dir/file_name`` and point ``latest.txt`` at it.

        Training waits only while the state is copied to CPU memory; rank 0 writes the file (or,
        :attr:`sharded`, every rank its shards) in the background, atomically, and calls
        ``then()`` once it is durable. The next save, :meth:`wait` and the end of ``train()``
        raise a failed write's ``OSError``. Every rank calls this; rank 0 gets the path (other
        ranks None).
        """
        state = self._live_state()
        # per rank, so that every rank's dropout and data-worker seeds resume exactly
        own_rng = self._data.rng_state(mid_pass=self._progress.position[1] > 0)
        self._refuse_unloadable(file_name, {**state, "rng": [own_rng]})
        if self._model_sharded:  # what one copy keeps for every rank must be the same
            from .sharded_checkpoint import check_rank_state

            check_rank_state(self, state)
        self._progress.mark_saved()
        path = os.path.join(self.ckpt_dir, file_name)
        if self.sharded:  # every rank writes its shards
            from .sharded_checkpoint import save

            save(self, state, own_rng, path, then)
        else:
            self._save_file(state, own_rng, path, then)
        if not is_main_process():
            return None
        self.last_path = path
        logger.info(f"Saving checkpoint {path} (after iteration {self._progress.iter + 1}).")
        return path

    def _save_file(
        self, state: dict[str, Any], own_rng: Any, path: str, then: Optional[Callable[[], None]]
    ) -> None:
        """Save one file of the whole (full) state: rank 0 writes it."""
        weights = None
        if self._model_sharded:  # FSDP2: every rank gathers the full states; rank 0 writes
            from .fsdp import full_state_dicts

            weights = full_state_dicts(self._model, self._optimizer)
        rng = gather(own_rng, group=self._cpu.group)
        if not is_main_process():
            return
        if weights is not None:  # gathered into fresh CPU tensors already: no second copy
            del state["model"], state["optimizer"]
        self.writer.wait()  # one copy in memory at a time; raises if the last write failed
        copied = files.copy_to_cpu({**state, "rng": rng})  # training goes on, changing `state`
        if weights is not None:
            copied["model"], copied["optimizer"] = weights
        mode = 0o666 & ~files.current_umask()  # read here, in the training thread
        folder, name = os.path.split(path)  # a file in a sub-folder gets a latest.txt there
        aside = files.aside(path)
        if os.path.isdir(path) and not os.path.islink(path):  # a sharded checkpoint's name
            os.replace(path, aside)  # (put back at the next start if the file never comes)

        def write() -> None:
            files.atomic_save(copied, path, mode)
            if os.path.lexists(aside):
                files.remove_checkpoint(aside)
            files.update_latest_pointer(folder, name, mode)
            logger.debug(f"Saved checkpoint {path}")  # the next log line names it
            if then is not None:
                then()

        self.writer.submit(write)

    def _live_state(self) -> dict[str, Any]:
        """Every part's ``state_dict()``, tensors on their devices."""
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
        """Refuse a state no resume could use: tensors not finite (as `latest` it would fail
        every rerun alike), or values ``weights_only`` loads cannot rebuild. Ranks agree."""
        optimizer = state["optimizer"]["state"]
        bad = files.bad_tensors({**state, "optimizer": optimizer}, self.parameters())
        unloadable = None
        try:
            files.check_plain(state)
        except files.UnloadableState as e:
            from .checkpoint_errors import unloadable_message

            unloadable = unloadable_message(file_name, e.path, e.value)
        if get_world_size() > 1:  # sharded state differs by rank: every rank must agree
            everyone = all_gather((bad, unloadable, self.writer.failed), group=self._cpu.group)
            if any(failed for *_, failed in everyone):
                self.raise_write_error()
            bad = sorted({name for names, _, _ in everyone for name in names})
            unloadable = next((message for _, message, _ in everyone if message), None)
        if unloadable or bad:
            from .checkpoint_errors import refusal

            raise refusal(file_name, self._progress.iter + 1, unloadable, bad)

    def wait(self) -> None:
        """Wait for the write in flight; raise its error, if any."""
        self.writer.wait()

    def raise_write_error(self) -> None:
        """Raise the failed write's error on the rank that failed, elsewhere one pointing at it."""
        self.writer.wait()
        raise RuntimeError(
            f"{'A rank' if self.sharded else 'Rank 0'} could not write a checkpoint (its log "
            "names the file and the reason); "
            f"every rank stops after iteration {self._progress.iter + 1}."
        )

    def remove_temp_files(self) -> None:
        """On rank 0, delete what writes interrupted by a crash left behind (every rank calls
        it, and waits for it)."""
        if is_main_process():
            pattern = os.path.join(self.ckpt_dir, f".*{files.TEMP_SUFFIX}")
            for stray in glob.glob(pattern) + glob.glob(pattern + files.ASIDE_SUFFIX):
                if os.path.isdir(stray) or stray.endswith(files.ASIDE_SUFFIX):  # sharded
                    from .sharded_checkpoint import remove_stray

                    remove_stray(stray)  # (it logs what it did)
                    continue
                os.remove(stray)
                logger.info(f"Removed {stray}, left by an interrupted checkpoint write.")
        all_gather("cleaned up", group=self._cpu.group)  # the others then list checkpoints

    def parameters(self) -> set[str]:
        """The names of the model's parameters in its ``state_dict`` (a tied weight's every one)."""
        return {name for name, _ in self._module.named_parameters(remove_duplicate=False)}

    def config(self) -> dict[str, Any]:
        """The ``config`` a checkpoint holds, with the optimizers' classes (a state does not
        fit another class)."""
        classes = {f"extra.{name}": type(obj).__name__ for name, obj in self._extra.items()}
        return {**self._config, "classes": {"optimizer": type(self._optimizer).__name__, **classes}}

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
        if path is None and auto_resume and revise_keys is None:
            self.wait()  # a write in flight may be the newest checkpoint
            if not glob.glob(os.path.join(self.ckpt_dir, "*.pth")):
                logger.debug(f"No checkpoint in {self.ckpt_dir}: training from scratch.")
                return False  # a fresh run: the loading code is not even imported
        from .checkpoint_load import load

        return load(self, path, auto_resume, resume, strict, revise_keys)
