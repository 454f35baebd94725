"""Whole-step CUDA graphs: capture forward, backward, clipping and the optimizer step once, then
replay them, so that a launch-bound step costs one graph launch instead of hundreds of kernels."""

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer

from .data import DataStream
from .metric_storage import Logged, MetricStorage
from .progress import Progress

logger = logging.getLogger(__name__)

# Eager iterations before the capture (PyTorch's recipe): they create the optimizer state, the
# GradScaler's scale and cuDNN/cuBLAS workspaces, which must exist before a capture.
WARMUP_ITERS = 3


def check_graphable(
    model: nn.Module,
    optimizer: Optimizer,
    device: torch.device,
    float16_scaler: bool,
    built_in_step: bool = True,
) -> None:
    """Raise a clear error when the trainer's step cannot be captured in a CUDA graph."""
    if not built_in_step:
        raise ValueError("cuda_graph=True captures the built-in train_one_iter, not an override.")
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a model on a CUDA device, got {device}.")
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise ValueError(f"cuda_graph=True does not support a {type(model).__name__} model yet.")
    groups = optimizer.param_groups
    # Optimizers with a `capturable` option (Adam, AdamW, ...) refuse a capture without it, fused
    # or not; SGD has none, and only its fused kernel reads a tensor LR without a host sync.
    if not all(g.get("capturable") or ("capturable" not in g and g.get("fused")) for g in groups):
        name = type(optimizer).__name__
        raise ValueError(f"cuda_graph=True needs capturable=True (SGD: fused=True), got {name}.")
    # the GradScaler of a float16 run reads the inf flag on the host unless the step is fused
    if float16_scaler and not all(g.get("fused") for g in groups):
        raise ValueError("cuda_graph=True with float16 AMP needs fused=True on the optimizer.")


class GraphedStep:
    """Runs ``step()``, the trainer's built-in ``train_one_iter``, eagerly for a few iterations,
    then captures it in a CUDA graph once and replays it.

    Each iteration's batches are fetched on the host first and copied into static buffers on the
    device, which the step then takes from ``data`` (put back there). What the step logs while it
    is captured is recorded, and after each replay logged again as copies (the next replay
    overwrites the graph's outputs). The optimizer's LRs live in device tensors during the
    capture, and each replay copies the current (scheduled) LRs into them, so warmup and LR
    schedules keep working. An iteration whose batches differ in structure, shape or dtype from
    the captured ones (the last partial batch, say) runs eagerly, logged once per layout.

    Args:
        step: The trainer's built-in step.
        update_scaler: Adjusts the float16 loss scale after the step, in the graph too (a
            replay runs no Python, so the loop's update after it would find nothing due).
        data: Where the step takes its batches from.
        storage: Where the step logs.
        progress: Where training is (the iteration a replay's values are logged at).
        optimizer: The optimizer ``step`` steps.
        device: The model's CUDA device.
        batches_per_step: The batches one step takes (``accumulation_steps``).
    """

    def __init__(
        self,
        step: Callable[[], None],
        update_scaler: Callable[[], None],
        data: DataStream,
        storage: MetricStorage,
        progress: Progress,
        optimizer: Optimizer,
        device: torch.device,
        batches_per_step: int,
    ) -> None:
        self._step = step
        self._update_scaler = update_scaler
        self._data = data
        self._storage = storage
        self._progress = progress
        self._optimizer = optimizer
        self._device = device
        self._batches_per_step = batches_per_step
        self._warmup_left = WARMUP_ITERS
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._static_inputs: list[torch.Tensor] = []
        self._layout: Any = None
        self._logged: list[Logged] = []  # what the captured step logs
        self._grads: list[Optional[torch.Tensor]] = []  # the graph's gradient buffers
        self._lrs: list[torch.Tensor] = []
        self._lr_values: list[float] = []
        self._seen_layouts: set[str] = set()

    def __call__(self) -> None:
        if self._warmup_left > 0:
            self._warmup_left -= 1
            self._on_side_stream()
            return
        batches = [self._data.next_batch() for _ in range(self._batches_per_step)]
        if self._graph is None:
            self._capture(batches)
        elif not self._copy_inputs(batches):
            self._eager(batches)
            return
        self._set_lrs()
        self._graph.replay()
        for metrics, options in self._logged:
            # copies: the next replay overwrites the outputs, and these wait for a log point
            copies = {name: value.clone() for name, value in metrics.items()}
            self._storage.add(self._progress.iter, copies, **options)

    def _step_and_update(self) -> None:
        self._step()
        self._update_scaler()

    def _on_side_stream(self) -> None:
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self._step_and_update()
        torch.cuda.current_stream(self._device).wait_stream(side)

    def _capture(self, batches: list[Any]) -> None:
        flat, self._layout = _flatten(batches)
        self._static_inputs = [t.to(self._device, copy=True) for t in flat]
        groups = self._optimizer.param_groups
        self._lr_values = [float(g["lr"]) for g in groups]
        self._lrs = [torch.tensor(lr, device=self._device) for lr in self._lr_values]
        graph = torch.cuda.CUDAGraph()
        try:
            for group, lr in zip(groups, self._lrs):
                group["lr"] = lr  # the graph reads the LR from this tensor on every replay
            self._data.put_back(_unflatten(self._layout, iter(self._static_inputs)))
            # thread_local: a data loader's pin-memory thread may call CUDA meanwhile
            with (
                self._storage.recording() as self._logged,
                torch.cuda.graph(graph, capture_error_mode="thread_local"),
            ):
                self._step_and_update()
        except Exception as e:
            # what a capture needs: docs/internals.md, "Whole-step CUDA graphs"
            raise RuntimeError(f"cuda_graph=True could not capture the step: {e!r}") from e
        finally:
            for group, lr in zip(groups, self._lr_values):
                group["lr"] = lr  # checkpoints and schedulers see plain numbers
        self._graph = graph
        self._grads = [p.grad for group in groups for p in group["params"]]
        logger.info(f"Captured the training step in a CUDA graph ({len(flat)} input tensors).")

    def _copy_inputs(self, batches: list[Any]) -> bool:
        flat, layout = _flatten(batches)
        if layout != self._layout:
            return False
        for static, new in zip(self._static_inputs, flat):
            static.copy_(new, non_blocking=True)
        return True

    def _set_lrs(self) -> None:
        for i, group in enumerate(self._optimizer.param_groups):
            if group["lr"] != self._lr_values[i]:
                self._lr_values[i] = group["lr"]
                self._lrs[i].fill_(group["lr"])  # a device-side fill: no sync

    def _eager(self, batches: list[Any]) -> None:
        key = repr(_flatten(batches)[1])
        if key not in self._seen_layouts:
            self._seen_layouts.add(key)
            logger.info(
                f"Batches of layout {key} differ from the captured {self._layout!r}: such "
                "iterations run eagerly."
            )
        self._data.put_back(batches)
        self._step_and_update()
        # the step's zero_grad dropped the graph's gradient buffers, which its replays fill
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        for param, grad in zip(params, self._grads):
            param.grad = grad


def _flatten(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """The tensors in nested lists, tuples and dicts, and a layout that compares equal only for
    the same structure, shapes, dtypes and non-tensor values."""
    tensors: list[torch.Tensor] = []

    def layout(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            tensors.append(o)
            return ("tensor", tuple(o.shape), o.dtype)
        if isinstance(o, (list, tuple)):
            return (type(o), tuple(layout(v) for v in o))
        if isinstance(o, dict):
            return (dict, tuple((k, layout(v)) for k, v in o.items()))
        return ("value", o)

    return tensors, layout(obj)


def _unflatten(layout: Any, tensors: Any) -> Any:
    kind, content = layout[:2]  # a tensor's layout holds its shape and dtype too
    if kind == "tensor":
        return next(tensors)
    if kind == "value":
        return content
    if kind is dict:
        return {k: _unflatten(v, tensors) for k, v in content}
    values = [_unflatten(v, tensors) for v in content]
    return kind(*values) if hasattr(kind, "_fields") else kind(values)  # namedtuples too
