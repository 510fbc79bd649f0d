"""Checks shared by the bench smoke tests: every figure printed in the house format
(`bench <name>: <ours> <unit> vs <baseline> <unit> = <ratio>x`, each number with a decimal
point and as many decimals as it needs, an optional `(target ...)` after it) and the same
figures, as positive finite numbers, in the JSON report."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

LINE = re.compile(
    r"^bench (?P<name>\S+): (?P<ours>\d+\.\d+) (?P<unit>GB/s|ms|ratio|tok/s|reads/s|%) "
    r"vs (?P<base_name>.+?) "
    r"(?P<base>\d+\.\d+) (?P=unit) = (?P<ratio>\d+\.\d+)x( \(target [^)]+\))?$"
)


def printed_figures(lines: Iterable[str]) -> dict[str, re.Match[str]]:
    """The `bench ...` lines, each checked against the house format, by figure name."""
    printed = {}
    for line in lines:
        if line.startswith("bench "):
            match = LINE.match(line)
            assert match, f"not in the house format: {line!r}"
            printed[match["name"]] = match
    return printed


def check_report(figures: dict[str, Any], printed: dict[str, re.Match[str]],
                 expected: set[str]) -> None:
    """The JSON figures are the printed ones, with the same units, baselines and ratios."""
    assert set(printed) == expected
    assert set(figures) == expected
    for name, figure in figures.items():
        for field in ("ours", "baseline", "ratio"):
            value = figure[field]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, field)
        assert figure["unit"] == printed[name]["unit"]
        assert figure["baseline_name"] == printed[name]["base_name"]
        assert _rounds_to(figure["ratio"], printed[name]["ratio"]), (name, figure["ratio"])


def _rounds_to(value: float, printed: str) -> bool:
    """printed is value to as many decimals as it shows (bench/figures.py `number` prints as
    many as a small value needs; a script with its own line format may print fewer)."""
    decimals = len(printed.partition(".")[2])
    return abs(value - float(printed)) <= 0.5 * 10.0 ** -decimals + 1e-12
