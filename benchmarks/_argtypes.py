"""argparse types shared by the benchmark scripts (imported from the script's own folder).

A count of 0, a negative one or a malformed shape used to pass argparse and fail later as a
traceback (`StatisticsError: no median for empty data`, `UnboundLocalError`, `high <= 0`),
often after minutes of model building and compiling, or to print a negative images/s. Each
type below turns such a value into argparse's one-line usage error naming the option.
"""
from __future__ import annotations

import argparse
import os


def positive_int(text: str) -> int:
    """An integer >= 1 (counts, batch sizes, threads, repeats)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def pair(text: str, what: str = "BATCHxSIZE", min_second: int = 1) -> tuple[int, int]:
    """Two whole numbers >= 1 written `AxB` (e.g. 16x128), the second at least `min_second`."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected {what} such as 16x128, got {text!r}")
    first, second = (int(p) for p in parts)
    if first < 1 or second < min_second:
        raise argparse.ArgumentTypeError(f"expected {what} with {what.split('x')[0]} >= 1 and "
                                         f"{what.split('x')[1]} >= {min_second}, got {text!r}")
    return first, second


def batch_x_size(text: str) -> tuple[int, int]:
    return pair(text, "BATCHxSIZE")


def rows_x_cols(text: str) -> tuple[int, int]:
    # bench_ops draws each row's k from [0, cols // 4): at least one choice needs 4 columns.
    return pair(text, "ROWSxCOLS", min_second=4)


def usable_cores() -> int:
    """The cores this process may run on (XLA:CPU sizes its thread pool by them): under
    `taskset -c 0` on a 2-core machine, 1, where `os.cpu_count()` says 2."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
