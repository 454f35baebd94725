"""The long messages of the rarer errors and warnings that a mistake in setting up a run causes
(arguments that do not fit together, a hook registered twice, a plateau metric that never comes,
a train() that cannot start again), imported when one is raised; each check stays where it is
made, and names its message."""

from typing import Any

from torch import nn
from torch.optim import Optimizer


def empty_optimizer(optimizer: Optimizer) -> ValueError:
    name = type(optimizer).__name__
    return ValueError(
        f"optimizer holds no parameters: {name} would step nothing. "
        f"Build it on the model's parameters: torch.optim.{name}(model.parameters(), ...)."
    )


def foreign_parameters(optimizer: Optimizer, foreign: list[nn.Parameter]) -> ValueError:
    shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
    return ValueError(
        f"optimizer holds {len(foreign)} parameters that are not the model's (shapes "
        f"{shapes}{', ...' if len(foreign) > 3 else ''}): stepping it would never change "
        "the model. Build it on this model's parameters, e.g. "
        f"torch.optim.{type(optimizer).__name__}(model.parameters(), ...), after moving the "
        "model to its device and wrapping or sharding it."
    )


def other_optimizer(lr_scheduler: Any, scheduled: Any, optimizer: Optimizer) -> ValueError:
    return ValueError(
        f"lr_scheduler schedules another optimizer ({type(scheduled).__name__} object at "
        f"{id(scheduled):#x}), not the trainer's optimizer ({type(optimizer).__name__} at "
        f"{id(optimizer):#x}), so the trainer's LR would never change. Build it on the "
        f"optimizer you pass: {type(lr_scheduler).__name__}(optimizer, ...)."
    )


def max_num_checkpoints_ignored() -> ValueError:
    return ValueError(
        "checkpoint_period=0 turns periodic checkpoints off, so max_num_checkpoints would be "
        "ignored; remove it, or pass a checkpoint_period >= 1."
    )


def not_writable(path: str, e: OSError) -> PermissionError:
    return PermissionError(
        f"{path!r} (the checkpoint folder in work_dir) is not writable ({e.strerror or e}); "
        "pass a writable work_dir."
    )


def cuda_graph_refused(compiled: bool) -> ValueError:
    if compiled:
        return ValueError(
            "A torch.compile-d model and cuda_graph=True do not combine here; for CUDA graphs "
            'under torch.compile, pass cuda_graph=False and compile with mode="reduce-overhead".'
        )
    return ValueError(
        "cuda_graph=True does not support models sharded with fully_shard (FSDP2): "
        "its collectives cannot be captured here. Pass cuda_graph=False."
    )


def warmup_settings_ignored(given: dict[str, Any], defaults: dict[str, Any]) -> ValueError:
    ignored = [f"{k}={v!r}" for k, v in given.items() if v != defaults[k]]
    return ValueError(
        f"lr_scheduler is an LRWarmupScheduler, which already holds its warmup and "
        f"by_epoch settings, so {', '.join(ignored)} would be ignored. Pass them to "
        "the LRWarmupScheduler, or pass the torch scheduler it wraps instead."
    )


def stream_without_epochs(max_epochs: int, data_loader: Any) -> ValueError:
    what = type(data_loader).__name__
    if getattr(data_loader, "dataset", None) is not None:
        what += f" over {type(data_loader.dataset).__name__}"
    return ValueError(
        f"max_epochs={max_epochs} needs a data_loader with a length, and this one "
        f"(a {what}) has none: it is a stream. Pass max_iters=N instead; an epoch is then "
        "one pass until the stream ends."
    )


def closure_needed(optimizer: Optimizer) -> TypeError:
    return TypeError(
        f"optimizer is a {type(optimizer).__name__}, whose step() needs a closure that "
        "re-evaluates the loss, and the built-in step calls step() once without one. Subclass "
        "Trainer and override train_one_iter:\n"
        "    def train_one_iter(self):\n"
        "        batch = self.next_batch()\n"
        "        def closure():\n"
        "            self.optimizer.zero_grad()\n"
        "            loss, self.losses = self.compute_losses(batch)\n"
        "            self.backward(loss)\n"
        "            return loss\n"
        "        self.optimizer.step(closure)\n"
        "        self.log_losses(**self.losses)"
    )


def unoptimized_warning(left: list[str]) -> str:
    return (
        f"{len(left)} trainable parameters of the model are in no optimizer and will not "
        f"change: {', '.join(left[:5])}{', ...' if len(left) > 5 else ''}. If that is "
        "meant, freeze them with requires_grad_(False); otherwise add them to the optimizer "
        "(or register a second one with trainer.checkpointer.register)."
    )


def restart_refused(
    cur_iter: int, max_iters: int, ckpt_dir: str, auto_resume: bool
) -> RuntimeError:
    """For a Trainer that trained before and has no checkpoint to resume from now."""
    done = f"iteration {cur_iter + 1} of {max_iters}"
    if auto_resume:
        why = f"and {ckpt_dir} holds no checkpoint to resume from"
    else:
        why = "so train(auto_resume=False) cannot start afresh"
    if cur_iter + 1 >= max_iters:
        return RuntimeError(
            f"This Trainer has trained to the end already ({done}): its model and optimizer "
            f"hold that state, {why}, and there is nothing left to train. To train again "
            "from scratch, build a new model, optimizer and Trainer; to train longer, build "
            "the Trainer with a larger max_epochs or max_iters."
        )
    go_on = "" if auto_resume else "To go on from the last checkpoint, call train(). "
    return RuntimeError(
        f"This Trainer has trained up to {done} in an earlier train(): its model and "
        f"optimizer hold that state, {why}. {go_on}To train again from scratch, build a new "
        "model, optimizer and Trainer."
    )


def hook_registered_already(hook: Any, here: bool) -> ValueError:
    if here:
        return ValueError(
            f"This {hook.class_name} is registered already: it would run twice per event. "
            "Register another instance if you want two."
        )
    return ValueError(
        f"This {hook.class_name} is registered on another trainer: a hook serves one "
        "trainer (self.trainer). Create another instance for this one, or unregister it "
        "from the other trainer first."
    )


def second_hook_of_a_kind(cls: type, hook: Any, twice: str) -> ValueError:
    return ValueError(
        f"A {cls.__name__} is registered already, and a second one would {twice}. "
        f"To configure it, replace it: trainer.unregister_hook({cls.__name__}), then "
        f"trainer.register_hook({type(hook).__name__}(...))."
    )


def plateau_metric_ignored(plateau_metric: str, scheduler: Any) -> ValueError:
    return ValueError(
        f"LRUpdateHook(plateau_metric={plateau_metric!r}) is only used with "
        f"ReduceLROnPlateau, and the trainer's lr_scheduler is "
        f"{type(scheduler.torch_scheduler or scheduler).__name__}; remove plateau_metric."
    )


def no_plateau_metric(default: str, cur_epoch: int) -> RuntimeError:
    return RuntimeError(
        "ReduceLROnPlateau needs a metric to judge, and no plateau_metric was given, "
        f"so it judges {default!r}, which nothing logged by the end of "
        f"epoch {cur_epoch + 1}. Either replace the default hook with "
        "LRUpdateHook(plateau_metric='<name>') (trainer.unregister_hook(LRUpdateHook) "
        "first), with a name your EvalHook returns (e.g. 'val_loss'), or return "
        f"{{{default!r}: value}} from an EvalHook(1, eval_func)."
    )


def plateau_metric_never_came(plateau_metric: str, logged: list[str]) -> str:
    return (
        f"LRUpdateHook(plateau_metric={plateau_metric!r}): no value of it was "
        "logged in training, so ReduceLROnPlateau never stepped. Logged: "
        f"{', '.join(logged)}."
    )
