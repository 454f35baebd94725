"""The base class of every hook, and the order hooks run in."""

from typing import Any


class Priority:
    """When a hook runs relative to the others: lower first, ties in registration order."""

    # The log point first: the period's times and LRs are logged, and its metrics moved off the
    # device, before any other hook reads them.
    TIMER = 5
    # The sampler epoch must be set before anything creates this epoch's data iterator.
    DISTRIBUTED = 10
    # User hooks run before the built-in ones below, so their effects are logged and saved.
    NORMAL = 50
    # Evaluation before the LR update, so ReduceLROnPlateau sees this epoch's metric.
    EVAL = 60
    LR_UPDATE = 70
    # Checkpoint after every hook that changes training state, so resume restarts exactly here.
    CHECKPOINT = 80
    # Logging last, so the console and TensorBoard show what every other hook wrote (at a save,
    # LoggerHook writes the log point before the checkpoint, which must cover it).
    LOGGER = 90


class HookBase:
    """Base class for hooks: override the events you need; the rest are no-ops.

    The trainer calls them like this (``train_one_iter`` is fetch, forward, backward, step)::

        hook.before_train()
        for epoch in range(start_epoch, max_epochs):  # a stream: passes until max_iters
            hook.before_epoch()
            for iter in range(start_iter, epoch_end):  # a stream: until its pass ends
                hook.before_iter()
                trainer.train_one_iter()
                hook.after_iter()  # every after_iter_period() iterations, and the last
            hook.after_epoch()
        hook.after_train()  # also when training raises

    ``self.trainer`` is a ``weakref.proxy`` to the trainer, set by ``register_hook``. A hook may
    end training with ``self.trainer.stop()``.

    Example::

        >>> class PrintLR(HookBase):
        ...     def after_epoch(self):
        ...         print(f"epoch {self.trainer.cur_epoch + 1}: lr={self.trainer.lr}")
    """

    priority: int = Priority.NORMAL
    trainer: Any = None

    def before_train(self) -> None:
        """Called once, before the first iteration."""

    def after_train(self) -> None:
        """Called once, after the last iteration or when training raised."""

    def before_epoch(self) -> None:
        """Called at the start of every epoch."""

    def after_epoch(self) -> None:
        """Called at the end of every epoch."""

    def before_iter(self) -> None:
        """Called before every ``train_one_iter``."""

    def after_iter(self) -> None:
        """Called after every ``train_one_iter`` (see [`after_iter_period`][])."""

    def after_eval(self, results: dict[str, float]) -> None:
        """Called with the numbers an ``EvalHook`` just logged (the same on every rank)."""

    def before_save_checkpoint(self) -> None:
        """Called on every rank before a checkpoint is saved: put on disk what it covers."""

    def after_iter_period(self) -> int:
        """Call [`after_iter`][] after every N-th iteration (and the last); 0: never. Asked at
        registration and when [`Trainer.train`][] starts."""
        return 1

    def state_dict(self) -> dict[str, Any]:
        """The hook's state as plain data, saved in checkpoints; empty for stateless hooks."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned."""

    @property
    def class_name(self) -> str:
        """The hook's class name (its key in checkpoints)."""
        return type(self).__name__

    @property
    def metric_storage(self) -> Any:
        """``trainer.metric_storage``: the metrics as of the last log point."""
        return self.trainer.metric_storage

    def log(self, *args: Any, **kwargs: Any) -> None:
        """``trainer.log(iter, smooth=True, **metrics)``: record metrics, kept on the device."""
        self.trainer.log(*args, **kwargs)

    @property
    def checkpointable(self) -> bool:
        """Whether the hook overrides [`state_dict`][] and so has state to save."""
        return type(self).state_dict is not HookBase.state_dict

    def every_n_epochs(self, n: int) -> bool:
        """Whether the current epoch is a multiple of ``n`` (counting from 1)."""
        return n > 0 and (self.trainer.cur_epoch + 1) % n == 0

    def every_n_iters(self, n: int) -> bool:
        """Whether the current iteration is a multiple of ``n`` (counting from 1)."""
        return n > 0 and (self.trainer.cur_iter + 1) % n == 0

    def every_n_inner_iters(self, n: int) -> bool:
        """Whether the iteration within the epoch is a multiple of ``n`` (counting from 1)."""
        return n > 0 and (self.trainer.inner_iter + 1) % n == 0

    def is_last_epoch(self) -> bool:
        """Whether this is the final epoch (of a stream: known from its last iteration on)."""
        if self.trainer.max_epochs is None:
            return self.is_last_iter()
        return self.trainer.cur_epoch == self.trainer.max_epochs - 1

    def is_last_iter(self) -> bool:
        """Whether this is the final iteration of training."""
        return self.trainer.cur_iter == self.trainer.max_iters - 1

    def is_last_inner_iter(self) -> bool:
        """Whether this is the final iteration of the epoch (of a stream: of training)."""
        return self.trainer.inner_iter == self.trainer.progress.epoch_iters - 1
