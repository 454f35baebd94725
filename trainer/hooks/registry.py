"""The trainer's hooks, in the order they run, and the timing of every call."""

import time
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Union

from .hookbase import HookBase

EVENTS = (
    "before_train",
    "after_train",
    "before_epoch",
    "after_epoch",
    "before_iter",
    "after_iter",
    "after_eval",
    "before_save_checkpoint",
)


class HookRegistry:
    """The trainer's hooks (``trainer.hooks``), sorted by ``priority`` (ties in registration
    order): iterate, index or ``len()`` it like a list. Each event calls only the hooks that
    override it, timing each.

    Args:
        owner: The trainer the hooks get as ``hook.trainer``.
        one_of_each: Classes of which one hook at most may be registered.
    """

    def __init__(self, owner: Any, one_of_each: tuple[type, ...] = ()) -> None:
        # A proxy, not a reference: the trainer owns its hooks, and a cycle would keep both alive.
        self._owner = weakref.proxy(owner)
        self._one_of_each = one_of_each
        self._hooks: list[HookBase] = []
        self.start()

    def __iter__(self) -> Iterator[HookBase]:
        return iter(list(self._hooks))

    def __len__(self) -> int:
        return len(self._hooks)

    def __getitem__(self, index: int) -> HookBase:
        return self._hooks[index]

    def register(self, hook: HookBase) -> None:
        """Add ``hook`` in priority order."""
        if not isinstance(hook, HookBase):
            raise TypeError(f"hook must be a HookBase instance, got {type(hook).__name__}.")
        if any(h is hook for h in self._hooks):
            raise ValueError(f"This {hook.class_name} is registered already: it would run twice.")
        if _alive(hook.trainer):
            raise ValueError(
                f"This {hook.class_name} belongs to another trainer: register a new one."
            )
        for cls in self._one_of_each:
            if isinstance(hook, cls) and any(isinstance(h, cls) for h in self._hooks):
                raise ValueError(
                    f"A {cls.__name__} is registered already, and a second would do its work "
                    f"twice: replace it, after trainer.unregister_hook({cls.__name__})."
                )
        hook.trainer = self._owner
        position = sum(1 for h in self._hooks if h.priority <= hook.priority)
        self._hooks.insert(position, hook)
        self.start()

    def unregister(self, hook: Union[HookBase, type]) -> list[HookBase]:
        """Remove ``hook``, or every hook of that class; returns what was removed."""
        removed = [
            h for h in self._hooks if h is hook or (isinstance(hook, type) and isinstance(h, hook))
        ]
        self._hooks = [h for h in self._hooks if all(h is not r for r in removed)]
        for h in removed:
            h.trainer = None
        self.start()
        return removed

    def start(self) -> None:
        """List each event's handlers (skipping HookBase's no-ops and the ``after_iter`` of
        period 0) and zero the times: at each change, and when a run starts, since a hook's
        [`after_iter_period`][HookBase.after_iter_period] may have changed since it was
        registered."""
        periods = {i: _period(h) for i, h in enumerate(self._hooks) if _overrides(h, "after_iter")}
        self._handlers: dict[str, list[tuple[int, Callable]]] = {
            event: [
                (i, getattr(h, event))
                for i, h in enumerate(self._hooks)
                if _overrides(h, event) and (event != "after_iter" or periods[i] > 0)
            ]
            for event in EVENTS
        }
        self._periods = [periods[i] for i, _ in self._handlers["after_iter"]]
        # no after_iter period ends strictly between these two counts of iterations done
        self._quiet_after = 0
        self._due = 0
        self._seconds = [0.0] * len(self._hooks)

    def call(self, event: str, *args: Any, every_handler: bool = False) -> None:
        """Run every hook's ``event`` handler, timing each; ``after_iter`` runs each hook after
        every ``after_iter_period()``-th iteration and the last. With ``every_handler``, a
        handler that raises does not stop the others; the first error is raised after them."""
        handlers = self._handlers.get(event)
        if handlers is None:
            raise ValueError(f"event must be one of {', '.join(EVENTS)}; got {event!r}.")
        if event == "after_iter":
            done = self._owner.progress.iter + 1
            last = done == self._owner.max_iters
            if self._quiet_after < done < self._due and not last:
                return
            handlers = [h for h, p in zip(handlers, self._periods) if last or done % p == 0]
            self._quiet_after = done
            self._due = min((done // p + 1) * p for p in self._periods) if self._periods else 0
        if handlers:
            self._run(handlers, args, every_handler)

    def _run(
        self, handlers: list[tuple[int, Callable]], args: tuple, every_handler: bool = False
    ) -> None:
        errors = []
        start = time.perf_counter()
        for i, handler in handlers:
            if handler.__self__.trainer is None:  # unregistered by a hook that ran before it
                continue
            try:
                handler(*args)
            except Exception as e:
                if not every_handler:
                    raise
                errors.append(e)
            end = time.perf_counter()  # ends this handler's time and starts the next one's
            self._seconds[i] += end - start
            start = end
        if errors:
            raise errors[0]

    def info(self) -> list[str]:
        """The hooks in the order they run, with their priorities."""
        return [f"{h.class_name} (priority {h.priority})" for h in self._hooks]

    def seconds_by_class(self) -> dict[str, float]:
        """Seconds spent in the hooks since training started, by class name (a hook's
        ``after_eval`` time also counts in the ``EvalHook`` that calls it)."""
        totals: dict[str, float] = {}
        for hook, seconds in zip(self._hooks, self._seconds):
            totals[hook.class_name] = totals.get(hook.class_name, 0.0) + seconds
        return totals

    def state_dict(self) -> dict[str, Any]:
        """The states of the hooks with state, keyed as [`checkpointable`][] keys them."""
        return {key: hook.state_dict() for key, hook in self.checkpointable().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Give each hook its state from [`state_dict`][]; one without keeps its own."""
        for key, hook in self.checkpointable().items():
            if key in state:
                hook.load_state_dict(state[key])

    def checkpointable(self) -> dict[str, HookBase]:
        """The hooks with state, keyed by class name (``Name_1``, ... for repeats)."""
        keys: dict[str, HookBase] = {}
        for h in self._hooks:
            if h.checkpointable:
                key = h.class_name
                n = 0
                while key in keys:
                    n += 1
                    key = f"{h.class_name}_{n}"
                keys[key] = h
        return keys


def _alive(trainer: Any) -> bool:
    """Whether a hook's ``trainer`` proxy is set and its trainer still exists."""
    try:
        return trainer is not None and trainer.__class__ is not None  # a dead proxy raises
    except ReferenceError:
        return False


def _period(hook: HookBase) -> int:
    period = hook.after_iter_period()
    if not isinstance(period, int) or isinstance(period, bool) or period < 0:
        raise ValueError(
            f"{hook.class_name}.after_iter_period() must return an int >= 0, got {period!r}."
        )
    return period


def _overrides(hook: HookBase, event: str) -> bool:
    method = getattr(hook, event)
    return getattr(method, "__func__", None) is not getattr(HookBase, event)
