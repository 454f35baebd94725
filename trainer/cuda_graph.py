"""Whole-step CUDA graphs: capture forward, backward, clipping and the optimizer step once, then
replay them, so that a launch-bound step costs one graph launch instead of hundreds of kernels."""

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer

logger = logging.getLogger(__name__)

Outputs = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]

# Eager iterations before the capture (PyTorch's recipe): they create the optimizer state, the
# GradScaler's scale and cuDNN/cuBLAS workspaces, which must exist before a capture.
WARMUP_ITERS = 3


def check_graphable(
    model: nn.Module, optimizer: Optimizer, device: torch.device, float16_scaler: bool
) -> None:
    """Raise a clear error when the trainer's step cannot be captured in a CUDA graph."""
    fix = "; or train without cuda_graph=True."
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a model on a CUDA device, got {device}{fix}")
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise ValueError(
            f"cuda_graph=True does not support a {type(model).__name__}-wrapped model yet{fix}"
        )
    groups = optimizer.param_groups
    # Optimizers with a `capturable` option (Adam, AdamW, ...) refuse a capture without it, fused
    # or not; SGD has none, and only its fused kernel reads a tensor LR without a host sync.
    if not all(g.get("capturable") or ("capturable" not in g and g.get("fused")) for g in groups):
        raise ValueError(
            "cuda_graph=True needs an optimizer that runs inside a CUDA graph with its LR in a "
            f"tensor, got {type(optimizer).__name__} without capturable=True (or fused=True for "
            "SGD). Pass capturable=True to Adam, AdamW and the like (with fused=True as well for "
            f"float16 AMP), or fused=True to SGD{fix}"
        )
    if float16_scaler and not all(g.get("fused") for g in groups):
        raise ValueError(
            "cuda_graph=True with float16 AMP needs a fused optimizer (fused=True): with others "
            "the GradScaler reads its inf flag on the host, which a CUDA graph cannot do. Or use "
            f"enable_amp=torch.bfloat16{fix}"
        )


class GraphedStep:
    """Runs ``step(batches)`` eagerly for a few iterations, then captures it once and replays it.

    Batches are copied into static buffers on the device; the optimizer's LRs live in device
    tensors during the capture, and each replay copies the current (scheduled) LRs into them, so
    warmup and LR schedules keep working. An iteration whose batches differ in structure, shape
    or dtype from the captured ones (the last partial batch, say) runs eagerly, logged once per
    layout.

    Args:
        step: The trainer's eager step: takes the micro-batches and ``set_to_none`` (for
            ``zero_grad``), returns the losses and the other metrics as device tensors.
        optimizer: The optimizer ``step`` steps.
        device: The model's CUDA device.
    """

    def __init__(
        self, step: Callable[[list[Any], bool], Outputs], optimizer: Optimizer, device: torch.device
    ) -> None:
        self._step = step
        self._optimizer = optimizer
        self._device = device
        self._warmup_left = WARMUP_ITERS
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._static_inputs: list[torch.Tensor] = []
        self._layout: Any = None
        self._outputs: Optional[Outputs] = None
        self._lrs: list[torch.Tensor] = []
        self._lr_values: list[float] = []
        self._seen_layouts: set[str] = set()

    def __call__(self, batches: list[Any]) -> Outputs:
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return self._on_side_stream(batches)
        if self._graph is None:
            self._capture(batches)
        elif not self._copy_inputs(batches):
            return self._eager(batches)
        self._set_lrs()
        self._graph.replay()
        losses, extras = self._outputs
        # Cloned: the next replay overwrites the static outputs, and these wait for a log point.
        return {k: v.clone() for k, v in losses.items()}, {k: v.clone() for k, v in extras.items()}

    def _on_side_stream(self, batches: list[Any]) -> Outputs:
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            outputs = self._step(batches, True)
        torch.cuda.current_stream(self._device).wait_stream(side)
        return outputs

    def _capture(self, batches: list[Any]) -> None:
        flat, self._layout = _flatten(batches)
        self._static_inputs = [t.to(self._device, copy=True) for t in flat]
        static_batches = _unflatten(self._layout, iter(self._static_inputs))
        groups = self._optimizer.param_groups
        self._lr_values = [float(g["lr"]) for g in groups]
        self._lrs = [torch.tensor(lr, device=self._device) for lr in self._lr_values]
        graph = torch.cuda.CUDAGraph()
        try:
            for group, lr in zip(groups, self._lrs):
                group["lr"] = lr  # the graph reads the LR from this tensor on every replay
            # thread_local: a data loader's pin-memory thread may call CUDA meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._outputs = self._step(static_batches, True)
        except Exception as e:
            raise RuntimeError(
                "cuda_graph=True could not capture the training step in a CUDA graph: "
                f"{type(e).__name__}: {e}\nA captured step must have static shapes, no host "
                "sync (.item(), .cpu(), printing a tensor) and no data-dependent control flow. "
                "Train with cuda_graph=False for this model."
            ) from e
        finally:
            for group, lr in zip(groups, self._lr_values):
                group["lr"] = lr  # checkpoints and schedulers see plain numbers
        self._graph = graph
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

    def _eager(self, batches: list[Any]) -> Outputs:
        key = repr(_flatten(batches)[1])
        if key not in self._seen_layouts:
            self._seen_layouts.add(key)
            logger.info(
                f"Batches of layout {key} differ from the captured {self._layout!r}: such "
                "iterations run eagerly."
            )
        # set_to_none=False keeps the captured gradient buffers as the parameters' .grad
        return self._step(batches, False)


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
    kind, content = layout[0], layout[1]
    if kind == "tensor":
        return next(tensors)
    if kind == "value":
        return content
    if kind is dict:
        return {k: _unflatten(v, tensors) for k, v in content}
    values = [_unflatten(v, tensors) for v in content]
    return kind(*values) if hasattr(kind, "_fields") else kind(values)  # namedtuples too
