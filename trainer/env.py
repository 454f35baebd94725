"""Environment information, as a table for the start of every log."""

import platform
import sys

import numpy as np
import torch
from tabulate import tabulate


def collect_env() -> str:
    """The versions and devices that matter for reproducing a run, as a tabulate table."""
    rows = [
        ("sys.platform", sys.platform),
        ("Python", sys.version.replace("\n", " ")),
        ("machine", platform.machine()),
        ("numpy", np.__version__),
        ("PyTorch", f"{torch.__version__} @ {torch.__file__.rsplit('/', 2)[0]}"),
        ("PyTorch debug build", torch.version.debug),
        ("CUDA available", torch.cuda.is_available()),
    ]
    if torch.cuda.is_available():
        rows.append(("CUDA (torch built with)", torch.version.cuda))
        rows.append(("cuDNN", torch.backends.cudnn.version()))
        for i in range(torch.cuda.device_count()):
            rows.append((f"GPU {i}", torch.cuda.get_device_name(i)))
    rows.append(("CPU threads", torch.get_num_threads()))
    return tabulate(rows, tablefmt="simple")
