"""The model without its wrappers (torch.compile, DDP, DataParallel), and the wrappers."""

import sys
from collections.abc import Iterator

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel


def unwrapped(model: nn.Module) -> nn.Module:
    """``model`` without its torch.compile and DDP / DataParallel wrappers."""
    *_, module = wrappers(model)
    return module


def wrappers(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` and the modules torch.compile / DDP / DataParallel wrap, outermost first."""
    # torch._dynamo is slow to import; a compiled model has imported it
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    while True:
        yield model
        if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        else:
            return
