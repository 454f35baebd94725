"""Gives distributed samplers their epoch."""

from torch.utils.data import IterableDataset

from .hookbase import HookBase, Priority


class DistributedHook(HookBase):
    """Calls ``set_epoch(epoch)`` on the data loader's sampler, batch sampler and
    ``IterableDataset`` where they have one (``DistributedSampler`` does) before each pass, so
    every pass shuffles differently and every rank agrees on the order.

    Example::

        >>> hook = DistributedHook()  # the Trainer registers one by default
    """

    priority = Priority.DISTRIBUTED

    def before_epoch(self) -> None:
        """Set the sampler epoch of the pass about to start."""
        loader = self.trainer.data_loader
        dataset = getattr(loader, "dataset", None)
        owners = [getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
        if isinstance(dataset, IterableDataset):
            owners.append(dataset)
        for owner in owners:
            if callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(self.trainer.cur_epoch)
