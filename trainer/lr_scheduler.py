"""Warmup on top of any ``torch.optim.lr_scheduler`` scheduler, how a run steps it, and the LRs
that are logged."""

import math
import warnings
from typing import Any, Optional

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    ChainedScheduler,
    ConstantLR,
    CosineAnnealingLR,
    LambdaLR,
    LinearLR,
    LRScheduler,
    MultiStepLR,
    OneCycleLR,
    PolynomialLR,
    ReduceLROnPlateau,
    SequentialLR,
)

from .misc import NUMBER, check_int, check_type

_WARMUP_MODES = ("fix", "factor", "auto")


def param_group_lrs(optimizer: Optimizer) -> dict[str, Any]:
    """The LR of each parameter group of ``optimizer`` as the metrics logged: ``lr`` (the first
    group), then ``lr/group1``, ``lr/group2``..."""
    groups = optimizer.param_groups
    return {"lr" if i == 0 else f"lr/group{i}": group["lr"] for i, group in enumerate(groups)}


class LRWarmupScheduler:
    """Wraps a PyTorch LR scheduler, left unchanged, and sets the LR of the first ``warmup_t``
    iterations (or epochs) by ``warmup_mode``:

    - ``"fix"``: linear from ``warmup_init_lr`` to the base LR.
    - ``"factor"``: the regular LR times a factor going linearly from ``warmup_factor`` to 1.
    - ``"auto"``: linear from ``base_lr * warmup_factor`` to the regular LR at the end of warmup.

    Call [`iter_update`][] after every iteration and [`epoch_update`][] after every epoch
    ([`LRUpdateHook`][hooks.LRUpdateHook] does both).

    Args:
        torch_scheduler: The scheduler to wrap, or None for a constant regular LR.
        by_epoch: Whether ``torch_scheduler`` steps once per epoch (True) or per iteration.
        epoch_len: Iterations per epoch, for ``"auto"`` with ``by_epoch`` and a warmup in
            iterations.
        warmup_t: Length of the warmup in iterations (or epochs); 0 disables warmup.
        warmup_by_epoch: Count ``warmup_t`` in epochs and update the warmup LR per epoch.
        warmup_mode: ``"fix"``, ``"factor"`` or ``"auto"``.
        warmup_init_lr: The first LR of ``"fix"`` warmup, >= 0.
        warmup_factor: The starting factor of ``"factor"`` and ``"auto"`` warmup, in [0, 1].
        optimizer: The optimizer, needed only when ``torch_scheduler`` is None.
    """

    def __init__(
        self,
        torch_scheduler: Optional[LRScheduler],
        by_epoch: bool = True,
        epoch_len: Optional[int] = None,
        warmup_t: int = 0,
        warmup_by_epoch: bool = False,
        warmup_mode: str = "fix",
        warmup_init_lr: float = 0.0,
        warmup_factor: float = 0.0,
        *,
        optimizer: Optional[Optimizer] = None,
    ) -> None:
        check_type("by_epoch", by_epoch, bool, "True or False")
        check_int("warmup_t", warmup_t, minimum=0, note="0 disables warmup")
        check_type("warmup_by_epoch", warmup_by_epoch, bool, "True or False")
        check_type("warmup_mode", warmup_mode, str, f"one of {_WARMUP_MODES}")
        if warmup_mode not in _WARMUP_MODES:
            raise ValueError(f"warmup_mode must be one of {_WARMUP_MODES}, got {warmup_mode!r}.")
        # a negative or NaN LR, or one above the regular LR, is no warmup
        check_type("warmup_init_lr", warmup_init_lr, NUMBER, "a finite number >= 0")
        if not 0.0 <= warmup_init_lr < math.inf:
            raise ValueError(
                f"warmup_init_lr must be a finite number >= 0 (the first LR of warmup), got "
                f"{warmup_init_lr!r}."
            )
        check_type("warmup_factor", warmup_factor, NUMBER, "a number in [0, 1]")
        if not 0.0 <= warmup_factor <= 1.0:
            raise ValueError(
                f"warmup_factor must be in [0, 1] (the first LR of warmup over the regular LR), "
                f"got {warmup_factor!r}."
            )
        if warmup_by_epoch and not by_epoch:
            raise ValueError("warmup_by_epoch=True needs by_epoch=True.")
        if torch_scheduler is None and optimizer is None:
            raise ValueError("Pass optimizer= when torch_scheduler is None.")
        if isinstance(torch_scheduler, ReduceLROnPlateau) and not by_epoch:
            raise ValueError("ReduceLROnPlateau steps at epoch ends: it needs by_epoch=True.")
        self.torch_scheduler = torch_scheduler
        self.optimizer = optimizer if torch_scheduler is None else torch_scheduler.optimizer
        self.by_epoch = by_epoch
        self.epoch_len = epoch_len
        self.warmup_t = warmup_t
        self.warmup_by_epoch = warmup_by_epoch
        self.warmup_mode = warmup_mode
        self.warmup_init_lr = warmup_init_lr
        self.warmup_factor = warmup_factor
        self.last_iter = self.last_epoch = 0
        # whether the optimizer holds warmup LRs (afterwards an LR set by hand stays)
        self._warming = False
        self.base_lrs = self._get_lrs()
        # chainable schedulers (StepLR, ...) step from the regular LR, not the warmup LR
        self.regular_lrs = list(self.base_lrs)
        # "auto" mode's target: the regular LRs at the end of warmup
        self.warmup_end_lrs: Optional[list[float]] = None
        if warmup_mode == "auto":
            self.warmup_end_lrs = self._regular_lrs_at_warmup_end()
        self._apply()

    @property
    def is_plateau(self) -> bool:
        """Whether the wrapped scheduler is ``ReduceLROnPlateau`` (needs a metric per step)."""
        return isinstance(self.torch_scheduler, ReduceLROnPlateau)

    @property
    def changes_per_iter(self) -> bool:
        """Whether [`iter_update`][] can change the LR (else it only counts ``last_iter``)."""
        return not self.by_epoch or (self.warmup_t > 0 and not self.warmup_by_epoch)

    def iter_update(self) -> None:
        """Set the LR for the next iteration; call after every iteration."""
        self.last_iter += 1
        if not self.by_epoch:
            self._step_regular()
        elif self.warmup_by_epoch or self.last_iter > self.warmup_t:
            return  # the LR is already the regular one, which only changes at epoch ends
        self._apply()

    def epoch_update(self, metric: Optional[float] = None) -> None:
        """Set the LR for the next epoch; call after every epoch with the ``metric`` that
        ``ReduceLROnPlateau`` judges (other schedulers ignore it)."""
        self.last_epoch += 1
        if self.by_epoch and not (self.is_plateau and metric is None):
            self._step_regular(metric)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """The warmup state and the wrapped scheduler's state, as plain data."""
        return {
            "last_iter": self.last_iter,
            "last_epoch": self.last_epoch,
            "regular_lrs": list(self.regular_lrs),
            "warmup_end_lrs": self.warmup_end_lrs,
            "torch_scheduler": (
                None if self.torch_scheduler is None else self.torch_scheduler.state_dict()
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned and set the optimizer's LRs to match."""
        self.last_iter = state["last_iter"]
        self.last_epoch = state["last_epoch"]
        self.regular_lrs = list(state["regular_lrs"])
        self.warmup_end_lrs = state["warmup_end_lrs"]
        if self.torch_scheduler is not None:
            self.torch_scheduler.load_state_dict(state["torch_scheduler"])
        # past warmup, the optimizer's state has the LRs unless a torch scheduler sets them
        self._warming = self.torch_scheduler is not None
        self._apply()

    def _get_lrs(self) -> list[float]:
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        # a tensor LR (Adam(lr=torch.tensor(...))) is copied: it changes in place
        return [lr.detach().clone() if isinstance(lr, torch.Tensor) else lr for lr in lrs]

    def _set_lrs(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # in place, as torch's schedulers do: a fused or
            else:  # CUDA-graphed step may hold that tensor
                group["lr"] = lr

    def _step_regular(self, metric: Optional[float] = None) -> None:
        if self.torch_scheduler is None:
            return
        self._set_lrs(self.regular_lrs)
        if self.is_plateau:
            self.torch_scheduler.step(metric)
        else:
            self.torch_scheduler.step()
        self.regular_lrs = self._get_lrs()

    def _apply(self) -> None:
        t = self.last_epoch if self.warmup_by_epoch else self.last_iter
        if t >= self.warmup_t:
            if self._warming:  # warmup ends: the regular LRs take over
                self._set_lrs(self.regular_lrs)
                self._warming = False
            return
        self._warming = True
        alpha = t / self.warmup_t
        if self.warmup_mode == "fix":
            lrs = [self.warmup_init_lr * (1 - alpha) + b * alpha for b in self.base_lrs]
        elif self.warmup_mode == "factor":
            factor = self.warmup_factor * (1 - alpha) + alpha
            lrs = [lr * factor for lr in self.regular_lrs]
        else:
            lrs = [
                b * self.warmup_factor * (1 - alpha) + end * alpha
                for b, end in zip(self.base_lrs, self.warmup_end_lrs)
            ]
        self._set_lrs(lrs)

    def _regular_lrs_at_warmup_end(self) -> list[float]:
        """Run the regular schedule to the end of warmup, and rewind it."""
        torch_scheduler = self.torch_scheduler
        if torch_scheduler is None or self.is_plateau:
            return list(self.base_lrs)
        per_epoch = self.by_epoch and not self.warmup_by_epoch
        steps = self.warmup_t // (self.epoch_len or 1) if per_epoch else self.warmup_t
        saved = torch_scheduler.state_dict()
        # A look-ahead, not training: torch's "step() before optimizer.step()" warning is moot.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            for _ in range(steps):
                torch_scheduler.step()
        end_lrs = self._get_lrs()
        torch_scheduler.load_state_dict(saved)
        self._set_lrs(self.base_lrs)
        return end_lrs


def schedule_horizon(scheduler: Any) -> Optional[int]:
    """The steps that ``scheduler``'s schedule spans: OneCycleLR's ``total_steps``,
    CosineAnnealingLR's ``T_max``, LinearLR's, ConstantLR's and PolynomialLR's ``total_iters``,
    MultiStepLR's last milestone, SequentialLR's last milestone plus its last scheduler's horizon,
    ChainedScheduler's longest, a LambdaLR's ``num_training_steps`` where its functions are
    ``functools.partial`` objects that carry it (transformers' ``get_scheduler`` builds them so);
    None for a schedule without an end (StepLR, another LambdaLR, ...)."""
    if isinstance(scheduler, OneCycleLR):
        return scheduler.total_steps
    if isinstance(scheduler, CosineAnnealingLR):
        return scheduler.T_max
    if isinstance(scheduler, (LinearLR, ConstantLR, PolynomialLR)):
        return scheduler.total_iters
    if isinstance(scheduler, MultiStepLR):
        return max(scheduler.milestones, default=None)
    if isinstance(scheduler, SequentialLR):  # the last scheduler starts at the last milestone
        last = schedule_horizon(scheduler._schedulers[-1])
        start = scheduler._milestones[-1] if scheduler._milestones else 0
        return None if last is None else start + last
    if isinstance(scheduler, ChainedScheduler):  # they all step together
        horizons = [schedule_horizon(s) for s in scheduler._schedulers]
        return None if None in horizons else max(horizons)
    if isinstance(scheduler, LambdaLR):
        steps = {_training_steps(getattr(f, "keywords", {})) for f in scheduler.lr_lambdas}
        return steps.pop() if len(steps) == 1 and None not in steps else None
    return None


def _training_steps(keywords: dict[str, Any]) -> Optional[int]:
    """The steps of a transformers schedule's ``partial``: ``num_training_steps``, or the
    phases of warmup_stable_decay's."""
    if "num_training_steps" in keywords:
        return keywords["num_training_steps"]
    phases = ("num_warmup_steps", "num_stable_steps", "num_decay_steps")
    return sum(keywords[k] for k in phases) if all(k in keywords for k in phases) else None


def check_steps(
    scheduler: LRWarmupScheduler, epochs: Optional[int], iters: int, epoch_len: Optional[int]
) -> None:
    """Refuse a schedule that a run of ``epochs`` of ``epoch_len`` iterations (None: a
    stream's, unknown) and ``iters`` in all would step in a unit its horizon contradicts
    (docs/arguments.md, "How the schedule steps"), and a OneCycleLR that the run would step past
    ``total_steps``, where it raises."""
    torch_scheduler = scheduler.torch_scheduler
    horizon = schedule_horizon(torch_scheduler)
    by_epoch = scheduler.by_epoch
    steps = epochs if by_epoch else iters
    run = f"{_count(epochs, 'epoch')} ({iters} iterations)" if epochs else f"{iters} iterations"
    said = f"by_epoch={by_epoch} steps {type(torch_scheduler).__name__} {_count(steps, 'time')}"
    said += f" in {run}"
    if horizon is not None and epochs is not None and epoch_len is not None:
        warmup = isinstance(torch_scheduler, ConstantLR) or (
            isinstance(torch_scheduler, LinearLR) and torch_scheduler.end_factor == 1
        )
        holds = isinstance(torch_scheduler, (LinearLR, MultiStepLR, PolynomialLR))  # its end
        if by_epoch and _counts_iterations(horizon, epochs, iters, epoch_len):
            raise ValueError(
                f"{said}, but its horizon of {horizon} steps counts iterations (past the run's "
                "epochs, at least an epoch's and half the run's iterations): pass by_epoch=False, "
                f"or build it for {_count(epochs, 'epoch')}."
            )
        # Stepped per iteration, a horizon shorter than an epoch counts epochs if the run's
        # epochs hold it, or if the schedule does not hold its end value (a cosine climbs
        # again); a warmup may be as short as it likes.
        short = horizon < min(epoch_len, iters) and not warmup
        if not by_epoch and short and (horizon <= epochs or not holds):
            raise ValueError(
                f"{said}, but its horizon of {horizon} steps is shorter than an epoch: it counts "
                f"epochs: pass by_epoch=True, or build it for {iters} iterations."
            )
    if isinstance(torch_scheduler, OneCycleLR) and steps and steps > torch_scheduler.total_steps:
        raise ValueError(
            f"{said}, past its total_steps={horizon}, where it raises: build it with "
            f"total_steps={steps}."
        )
    warmup_t = scheduler.warmup_t
    if scheduler.warmup_by_epoch and epochs is not None and epoch_len is not None:
        if _counts_iterations(warmup_t, epochs, iters, epoch_len):
            raise ValueError(
                f"warmup_by_epoch=True counts warmup_t={warmup_t} in epochs, but it counts "
                f"iterations (past the run's {_count(epochs, 'epoch')}, at least an epoch's and "
                f"half the run's {iters} iterations): pass warmup_by_epoch=False."
            )


def _counts_iterations(horizon: int, epochs: int, iters: int, epoch_len: int) -> bool:
    """Whether a horizon stepped per epoch is one of iterations: past the run's epochs, at least
    an epoch's iterations (or the run's, if shorter), and at least half the run's iterations."""
    return epochs < horizon and min(epoch_len, iters) <= horizon and iters <= 2 * horizon


def _count(n: Optional[int], unit: str) -> str:
    return "once" if unit == "time" and n == 1 else f"{n} {unit}{'' if n == 1 else 's'}"


def describe_steps(scheduler: LRWarmupScheduler, epochs: Optional[int], iters: int) -> str:
    """How a run of ``epochs`` (None: a stream's, unknown) and ``iters`` steps ``scheduler``, in
    one line: which scheduler, per epoch or per iteration, how many steps, and the warmup."""
    torch_scheduler = scheduler.torch_scheduler
    if torch_scheduler is None:
        line = "constant (lr_scheduler=None)"
    else:
        line = type(torch_scheduler).__name__
        if not scheduler.by_epoch:
            line += f" stepped per iteration (by_epoch=False), {iters} steps in this run"
        elif epochs is not None:
            line += f" stepped per epoch (by_epoch=True), {epochs} steps in this run"
        else:
            line += " stepped per epoch (by_epoch=True), at each end of the data stream"
        horizon = schedule_horizon(torch_scheduler)
        if horizon is not None:
            line += f" (its horizon: {horizon})"
    if scheduler.warmup_t:
        unit = "epochs" if scheduler.warmup_by_epoch else "iterations"
        return f"{line}; warmup: {scheduler.warmup_t} {unit}, {scheduler.warmup_mode!r} mode."
    return f"{line}; no warmup."
