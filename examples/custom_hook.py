"""Write a hook of your own: stop early when the loss is small, and keep a count across resume.

python examples/custom_hook.py
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import HookBase, Trainer, set_random_seed


class LossThresholdHook(HookBase):
    """Counts log points whose smoothed loss is under ``threshold``; prints a line at each."""

    def __init__(self, threshold: float, period: int = 10) -> None:
        self.threshold = threshold
        self.period = period
        self.hits = 0

    def after_iter_period(self) -> int:
        return self.period  # after_iter is called after every period-th and the last iteration

    def after_iter(self) -> None:
        # The storage holds each log point's values: read them at log points.
        if not self.every_n_iters(self.period):  # (the last iteration may be another)
            return
        loss = self.trainer.metric_storage["total_loss"].avg
        if loss < self.threshold:
            self.hits += 1
            print(f"iter {self.trainer.cur_iter + 1}: loss {loss:.4f} < {self.threshold}")

    def state_dict(self) -> dict:
        return {"hits": self.hits}  # plain data: checkpoints stay loadable with weights_only

    def load_state_dict(self, state: dict) -> None:
        self.hits = state["hits"]


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)


def main() -> int:
    set_random_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1) + 0.01 * torch.randn(256, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = Regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(
        model, optimizer, None, loader, max_iters=200, work_dir="work_dir/custom_hook",
        log_period=10,
    )  # fmt: skip
    hook = LossThresholdHook(threshold=0.01, period=10)
    trainer.register_hook(hook)
    trainer.train(auto_resume=False)
    print(f"log points under the threshold: {hook.hits}")
    return hook.hits


if __name__ == "__main__":
    main()
