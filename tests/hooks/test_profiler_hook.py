import json
import os

import pytest

from trainer.hooks import ProfilerHook


def test_writes_a_trace_of_the_window(make_trainer):
    trainer = make_trainer(max_epochs=1)
    trainer.register_hook(ProfilerHook(start_iter=2, num_iters=3))
    trainer.train()
    path = os.path.join(trainer.work_dir, "profiler", "rank0_iter3-5.pt.trace.json")  # 3 to 5
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(name.startswith("aten::") for name in names)  # the step's operators


def test_a_run_ending_inside_the_window_still_writes(make_trainer):
    trainer = make_trainer(max_epochs=1)  # 8 iterations
    trainer.register_hook(ProfilerHook(start_iter=6, num_iters=10))
    trainer.train()
    assert os.listdir(os.path.join(trainer.work_dir, "profiler")) == ["rank0_iter7-8.pt.trace.json"]


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="num_iters must be a positive int, got 0"):
        ProfilerHook(start_iter=0, num_iters=0)
    with pytest.raises(ValueError, match="start_iter must be an int >= 0, got -1"):
        ProfilerHook(start_iter=-1)
    with pytest.raises(TypeError, match="start_iter must be an int >= 0, got float 2.5"):
        ProfilerHook(start_iter=2.5)
