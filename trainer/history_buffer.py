"""core-pytorch-utils' ``cpu.history_buffer`` path: :class:`HistoryBuffer`."""

from .metric_storage import HistoryBuffer

__all__ = ["HistoryBuffer"]
