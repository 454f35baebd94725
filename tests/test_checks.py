import pytest

from trainer.checks import NUMBER, check_int, check_type
from trainer.hooks import (
    BestCheckpointHook,
    EarlyStoppingHook,
    EMAHook,
    LoggerHook,
    LRUpdateHook,
    ProgressBarHook,
    WatchdogHook,
)


def test_check_int_tells_a_wrong_type_from_a_small_value():
    check_int("n", 0, minimum=0)
    with pytest.raises(TypeError, match=r"^n must be a positive int, got bool True\.$"):
        check_int("n", True, minimum=1)
    with pytest.raises(ValueError, match=r"^n must be an int >= 0 \(0 means never\), got -1\.$"):
        check_int("n", -1, minimum=0, note="0 means never")
    with pytest.raises(ValueError, match=r"^period must be a positive int, got 0\.$"):
        check_int("period", 0, minimum=1)


def test_check_type_lets_a_bool_through_only_where_bool_is_named():
    check_type("x", 1.5, NUMBER, "a number")
    check_type("flag", True, bool, "True or False")
    with pytest.raises(TypeError, match=r"^x must be a number, got bool False\.$"):
        check_type("x", False, NUMBER, "a number")
    with pytest.raises(TypeError, match=r"^decay must be a number in \[0, 1\), got str '0\.9'\.$"):
        check_type("decay", "0.9", NUMBER, "a number in [0, 1)")


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: EMAHook(decay="0.9"), TypeError, r"decay must be a number in \[0, 1\), got str"),
        (lambda: EarlyStoppingHook(5), TypeError, "metric must be a str .*, got int 5"),
        (lambda: BestCheckpointHook(None), TypeError, "metric must be a str .*, got NoneType"),
        (lambda: EarlyStoppingHook("acc", min_delta="0"), TypeError, "min_delta must be a number"),
        (lambda: ProgressBarHook(interval="1"), TypeError, "interval must be a number of seconds"),
        (lambda: ProgressBarHook(interval=0), ValueError, "interval must be .* > 0, got 0"),
        (lambda: WatchdogHook(factor="10"), TypeError, "factor must be a number > 1, got str"),
        (lambda: WatchdogHook(min_seconds=None), TypeError, "min_seconds must be a number > 0"),
        (lambda: LRUpdateHook(plateau_metric=1), TypeError, "plateau_metric must be a str or None"),
        (lambda: LoggerHook(writers=[print]), TypeError, "writers must be a list of trainer.wri"),
    ],
)
def test_hook_arguments_of_the_wrong_type_or_range_are_named(build, error, message):
    with pytest.raises(error, match=message):
        build()
