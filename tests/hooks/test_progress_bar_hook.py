import contextlib
import io
import logging
import os
import re
import threading

from trainer.hooks import ProgressBarHook
from trainer.hooks.progress_bar_hook import LiveLine
from trainer.logger import _console_handler

from conftest import FakeClock, Tick


class Terminal(io.StringIO):
    def isatty(self):
        return True


def drawn_lines(output):
    """The screen's lines: each redraw (\\r) overwrites the line it is on."""
    return [line.split("\r")[-1].replace("\x1b[K", "") for line in output.split("\n")]


def test_the_bar_draws_each_epoch_on_a_terminal_a_few_times_a_second(make_trainer, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("trainer.hooks.progress_bar_hook.time", clock)
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback: os.terminal_size((80, 24)))
    terminal = Terminal()
    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.register_hooks([Tick(clock, 0.05), ProgressBarHook(interval=0.2, stream=terminal)])
    trainer.train()
    output = terminal.getvalue()
    # at most one redraw per 0.2 s (4 iterations of 0.05 s), plus each epoch's last one
    assert output.count("\r") == 2 * (2 + 1)
    epoch_1, epoch_2, rest = drawn_lines(output)
    loss = trainer.metric_storage.value_maybe_smooth("total_loss")  # as of the last log point
    assert re.fullmatch(r"epoch 1/2 \[#+\] 8/8  20 it/s  ETA 0:00:00  loss [\d.]+", epoch_1)
    assert re.fullmatch(r"epoch 2/2 \[#+\] 8/8  20 it/s  ETA 0:00:00  loss (.+)", epoch_2)
    assert epoch_2.endswith(f"loss {loss:.4g}") and len(epoch_1) == len(epoch_2) == 79  # width
    first_draw = output.split("\r")[1]  # after 1 of 8 iterations: 1/8 of the bar
    assert re.fullmatch(r"epoch 1/2 \[(#*)(-*)\] 1/8  20 it/s  ETA 0:00:00\x1b\[K", first_draw)
    assert rest == ""  # each epoch's line ended, and nothing after


def test_the_bar_shows_the_eta_of_the_run_and_a_stream_without_a_total(make_trainer, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("trainer.hooks.progress_bar_hook.time", clock)
    terminal = Terminal()
    stream = [batch for batch in make_trainer(max_epochs=1).data_loader]  # 8 batches
    trainer = make_trainer(max_iters=12, loader=iter_forever(stream), log_period=4)
    trainer.register_hooks([Tick(clock, 1.0), ProgressBarHook(interval=0.1, stream=terminal)])
    trainer.train()
    lines = terminal.getvalue().split("\r")
    # after 3 of 12 iterations of 1 s, 9 more take 9 s; no bar and no total in a stream
    assert lines[3] == "epoch 1 [3]  1 it/s  ETA 0:00:09\x1b[K"
    assert drawn_lines(terminal.getvalue())[0].startswith("epoch 1 [12]  1 it/s  ETA 0:00:00")


class iter_forever:
    """A stream (no length) that yields the same batches forever."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        while True:
            yield from self.batches


def test_no_bar_where_the_console_is_not_a_terminal(make_trainer):
    stream = io.StringIO()
    trainer = make_trainer(max_epochs=1)
    # none is registered by default, with or without progress_bar
    assert not any("ProgressBarHook" in h for h in trainer.hooks.info())
    trainer.register_hook(ProgressBarHook(stream=stream))  # and one registered draws nothing
    trainer.train()
    assert stream.getvalue() == ""


def test_on_a_terminal_the_bar_is_a_default_hook_that_unregisters(make_trainer, monkeypatch):
    monkeypatch.setattr("sys.stderr", Terminal())
    trainer = make_trainer(max_epochs=1)
    assert "ProgressBarHook (priority 91)" in trainer.hooks.info()
    assert [type(h) for h in trainer.unregister_hook(ProgressBarHook)] == [ProgressBarHook]
    assert not any("ProgressBarHook" in h for h in trainer.hooks.info())


@contextlib.contextmanager
def drawing_on(terminal, monkeypatch):
    """(a logger printing on ``terminal`` through the console handler, the live line there)"""
    monkeypatch.setattr("sys.stderr", terminal)
    handler = _console_handler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("trainer.test_bar")
    log.addHandler(handler)
    line = LiveLine(terminal)
    monkeypatch.setattr("trainer.logger.live_line", line)
    try:
        yield log, line
    finally:
        log.removeHandler(handler)


def test_a_log_line_clears_the_bar_and_draws_it_again_below(monkeypatch):
    terminal = Terminal()
    with drawing_on(terminal, monkeypatch) as (log, line):
        line.show("epoch 1 [##--] 2/4")
        log.warning("a log line")
        line.finish()
    assert terminal.getvalue() == (
        "\repoch 1 [##--] 2/4\x1b[K"  # the bar
        "\r\x1b[Ka log line\n"  # cleared, the log line
        "\repoch 1 [##--] 2/4\x1b[K\n"  # the bar again, then ended
    )
    assert drawn_lines(terminal.getvalue()) == ["a log line", "epoch 1 [##--] 2/4", ""]


class HeldTerminal(Terminal):
    """A terminal whose write of a record's text waits until ``go`` is set."""

    def __init__(self, record):
        super().__init__()
        self.record, self.writing, self.go = record, threading.Event(), threading.Event()

    def write(self, text):
        if text.startswith(self.record):
            self.writing.set()
            assert self.go.wait(timeout=60)
        return super().write(text)


def test_a_record_from_another_thread_is_never_drawn_over_by_the_bar(monkeypatch):
    """A checkpoint's "Saved ... (on disk)" comes from the writer thread: while it is written,
    the bar's redraw from the training thread waits, so the record keeps a line of its own."""
    terminal = HeldTerminal("saved")
    with drawing_on(terminal, monkeypatch) as (log, line):
        line.show("epoch 1 [#---] 1/4")
        writer = threading.Thread(target=log.warning, args=("saved",))
        writer.start()
        assert terminal.writing.wait(timeout=60)  # the record is being written
        redraw = threading.Thread(target=line.show, args=("epoch 1 [##--] 2/4",))
        redraw.start()
        redraw.join(timeout=0.2)  # it cannot end while the record is written
        terminal.go.set()
        writer.join()
        redraw.join()
        line.finish()
    assert terminal.getvalue() == (
        "\repoch 1 [#---] 1/4\x1b[K"  # the bar
        "\r\x1b[Ksaved\n"  # cleared, the record
        "\repoch 1 [#---] 1/4\x1b[K"  # the bar again below it
        "\repoch 1 [##--] 2/4\x1b[K\n"  # then the redraw, which waited
    )
