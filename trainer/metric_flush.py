"""What :meth:`MetricStorage.flush <trainer.MetricStorage.flush>` does only under torchrun
(reduce values over ranks) or after a non-finite loss (keep what came before it, and raise)."""

import math
import statistics
from typing import Any, Optional

import torch

from .distributed import all_gather_tensor
from .metric_storage import _MAX_REDUCED, MetricStorage, _Series, _stacked, _to_host


def reduced_numbers(pending: dict[str, _Series], cpu_group: Any) -> dict[str, list[float]]:
    """The pending values as numbers: this rank's in one transfer, the ``reduce`` ones reduced
    over ranks in one collective, by mean, or by max for times and skipped steps."""
    reduced = sorted(n for n, s in pending.items() if s.reduce)  # the same order on every rank
    local = [n for n in pending if n not in reduced]
    # note: the one CPU-GPU sync of a log period
    numbers = dict(zip(local, _to_host([pending[n].values for n in local])))
    series = [pending[n].values for n in reduced]
    device = _device_of(series)
    packed = torch.cat([_stacked(values, device, torch.float64) for values in series])
    # on CPU over the trainer's gloo group (cpu_group), on the GPU over the default one
    group = cpu_group if packed.device.type == "cpu" else None
    columns = iter(zip(*all_gather_tensor(packed, group).tolist()))  # each: every rank's
    for n in reduced:
        reduce = max if n in _MAX_REDUCED else statistics.fmean
        numbers[n] = [reduce(next(columns)) for _ in pending[n].values]
    return numbers


def _device_of(series: list[list[Any]]) -> torch.device:
    for values in series:
        for v in values:
            if isinstance(v, torch.Tensor):
                return v.device
    # plain numbers only: the collective still needs the backend's device (CUDA for nccl)
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else _CPU


_CPU = torch.device("cpu")


def keep_until_first_bad(
    storage: MetricStorage,
    pending: dict[str, _Series],
    numbers: dict[str, list[float]],
    epoch_len: Optional[int],
) -> None:
    """Add the values from before the first iteration with a non-finite ``check_finite`` value
    to ``storage``, and raise ``FloatingPointError`` naming that iteration."""
    first_bad = min(
        it
        for name, series in pending.items()
        if series.check_finite
        for it, value in zip(series.iters, numbers[name])
        if not math.isfinite(value)
    )
    at_first_bad = {}
    for name, series in pending.items():
        iters, values = series.iters, numbers[name]
        if first_bad in iters:
            at_first_bad[name] = values[iters.index(first_bad)]
        keep = [i for i, it in enumerate(iters) if it < first_bad]
        storage.extend(name, [iters[i] for i in keep], [values[i] for i in keep], series.smooth)
    checked = [n for n, s in pending.items() if s.check_finite and n in at_first_bad]
    bad = [n for n in checked if not math.isfinite(at_first_bad[n])]
    what = "Loss" if set(bad) - {"grad_norm"} else "The gradient norm (the loss was not)"
    epoch = f" (epoch {first_bad // epoch_len})" if epoch_len else ""
    raise FloatingPointError(
        f"{what} became NaN or infinite at iteration {first_bad}{epoch}: "
        f"{at_first_bad}. Lower the LR, enable "
        "clip_grad_norm, or check the data of that iteration."
    )
