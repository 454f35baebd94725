"""Trainer names that moved or went after 0.1.0 (see CHANGELOG.md), and what to use instead:
imported when a program reads one, or subclasses the Trainer."""

MOVED = {
    "call_hooks": "trainer.hooks.call(event, ...)",
    "hook_info": "trainer.hooks.info()",
    "hook_seconds": "trainer.hooks.seconds_by_class()",
    "register_checkpointable": "trainer.checkpointer.register(name, obj)",
    "last_checkpoint": "trainer.checkpointer.last_path",
    "wait_for_checkpoint": "trainer.checkpointer.wait()",
    "checkpoint_name": "trainer.checkpointer.name()",
    "data_seconds": "trainer.progress.data_seconds",
    "amp_dtype": 'trainer.run_config["amp_dtype"]',
    "device": "the device of the model's parameters",
    "step_skipped": "trainer.grad_scaler.get_scale() before and after update_scaler()",
    "forward_backward_step": "train_one_iter, with the public step methods",
}


def missing_attribute(cls: type, name: str) -> str:
    """The message for ``name`` not found on a ``cls`` object: where a moved name went."""
    if name in MOVED:
        return f"Trainer.{name} is gone (see CHANGELOG.md): use {MOVED[name]} instead."
    return f"{cls.__name__!r} object has no attribute {name!r}"


def refuse_moved_overrides(cls: type) -> None:
    """Refuse a Trainer subclass that defines a moved name: the trainer would never call it."""
    moved = sorted(name for name in MOVED if name in vars(cls))
    if moved:
        raise TypeError(
            f"{cls.__name__} defines {', '.join(moved)}, which the Trainer no longer has or "
            f"calls, so it would be ignored: {'; '.join(f'{n}: {MOVED[n]}' for n in moved)}."
        )
