from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from conftest import tiny_dataset


def test_distributed_sampler_gets_each_epoch_before_its_pass(make_trainer):
    orders = []
    sampler = DistributedSampler(tiny_dataset(), num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = DataLoader(tiny_dataset(), batch_size=4, sampler=sampler)
    trainer = make_trainer(loader=loader, max_iters=24)
    original = trainer.next_batch

    def next_batch():
        if trainer.inner_iter == 0:
            orders.append((sampler.epoch, list(iter(sampler))))
        return original()

    trainer.next_batch = next_batch
    trainer.train()
    assert [epoch for epoch, _ in orders] == [0, 1, 2]
    assert len({tuple(order) for _, order in orders}) == 3  # a new shuffle every pass


class EpochStream(IterableDataset):
    """A stream that shuffles by its epoch, as streaming datasets do with set_epoch."""

    def __init__(self):
        self.epoch, self.epochs_seen = 0, []

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        self.epochs_seen.append(self.epoch)
        yield from tiny_dataset(8)


def test_a_stream_with_set_epoch_gets_each_epoch_before_its_pass(make_trainer):
    stream = EpochStream()
    trainer = make_trainer(loader=DataLoader(stream, batch_size=4), max_iters=5)
    trainer.train()
    assert stream.epochs_seen == [0, 1, 2]  # passes of 2 iterations
