"""The house format of every benchmark figure: one line
`bench <name>: <ours> <unit> vs <baseline> <unit> = <ratio>x`, the same as JSON, and the end of
every bench script's main (`run_main`); the data behind a plot that the figure lines do not
carry, as one line `plot <name> <compact JSON object>` (`plot_line`; bench/run_all.py keeps
it in the report, bench/plots.py draws it); what a figure's target says and whether the figure
met it (`parse_target`, `judge`); and the timing of ours against a baseline, repeat by repeat
(`Op`, `paired`, `gbps_figure`).

Numbers print with at least two decimals (three in ms) and at least two significant digits
(`number`), so that no value that is not zero prints as 0.00: a token hit rate of 0.0041
against LRU's 0.0030 prints as such, not as `0.00 vs 0.00 = 1.36x`.

A target is `[label] [op] <value>x` for the ratio (ratio > 1 always means ours is better) or
`[label] <op> <value> <unit>` for ours in the figure's own unit, then anything after a comma
or a space is a note for people: `>= 0.8x`, `1.00x`, `~1.00x`,
`>= 0.91x, i.e. TPOT with loads <= 1.1x`, `p50 <= 0.45 ms`. op is one of >=, >, <=, < and ~
(within APPROX_REL of the value); a bare ratio is a floor (the same as >=). A figure is judged
on its numbers as printed, so a verdict never disagrees with the line a reader sees."""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Figure:
    name: str
    ours: float
    baseline_name: str
    baseline: float
    unit: str
    lower_is_better: bool = False
    target: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.baseline / self.ours if self.lower_is_better else self.ours / self.baseline

    def line(self) -> str:
        decimals = decimals_for(self.unit)
        target = f" (target {self.target})" if self.target else ""
        return (f"bench {self.name}: {number(self.ours, decimals)} {self.unit} vs "
                f"{self.baseline_name} {number(self.baseline, decimals)} {self.unit} = "
                f"{number(self.ratio)}x{target}")

    def as_json(self) -> dict[str, Any]:
        return {"ours": self.ours, "baseline_name": self.baseline_name,
                "baseline": self.baseline, "unit": self.unit, "ratio": self.ratio,
                "target": self.target, **self.extra}


#: Two significant digits tell a reader a small value's size to within 5% (0.0041 against
#: 0.0030), which is finer than a quick run's noise, and keep every figure that reads 0.10 or
#: more as short as it always was.
SIGNIFICANT = 2


def decimals_for(unit: str) -> int:
    """The fewest decimals a value in unit prints with: three in ms (a lookup of 0.123 ms),
    two in the rest."""
    return 3 if unit == "ms" else 2


def number(value: float, decimals: int = 2) -> str:
    """value in fixed point with at least `decimals` decimals and SIGNIFICANT significant
    digits: 1234.5678 -> 1234.57, 0.4937 -> 0.49, 0.004123 -> 0.0041 (0.00 only for 0)."""
    if value and math.isfinite(value):
        decimals = max(decimals, SIGNIFICANT - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"

#: "~1.00x" holds within 2%: trace_replay's live store against its own simulation (the one
#: figure that uses ~) differs by less than that on every run the smoke test has seen, and a
#: bigger gap means the live store and the simulation no longer agree.
APPROX_REL = 0.02

MET, MISSED, NO_TARGET, NOT_UNDERSTOOD = "met", "missed", "no target", "target not understood"

TARGET = re.compile(
    r"^(?:(?P<label>[A-Za-z]\w*) )?(?P<op>>=|<=|>|<|~)? ?(?P<value>\d+(?:\.\d+)?)"
    r"(?:x|(?: (?P<unit>[^\s,;]+)))(?P<note>(?:[,;]? .*)?)$")


@dataclass(frozen=True)
class Target:
    """What a target asks: `op` (>=, >, <=, < or ~) `value`, of the ratio when unit is "x",
    else of ours in `unit`."""

    op: str
    value: float
    unit: str


def parse_target(text: str) -> Target:
    """The target a figure line's `(target ...)` names; ValueError saying why when it is
    not one this module can judge (see the module's docstring for the forms)."""
    match = TARGET.match(text.strip())
    if not match:
        raise ValueError("not [label] [>=|>|<=|<|~] <number>x or <op> <number> <unit>")
    unit = match["unit"] or "x"
    if unit != "x" and not match["op"]:
        raise ValueError(f"no >=, >, <=, < or ~ before {match['value']} {unit}: a bare value is "
                         "a floor only for a ratio, where more is always better")
    return Target(match["op"] or ">=", float(match["value"]), unit)


def judge(target: str, ours: float, ratio: float, unit: str) -> tuple[str, str]:
    """(verdict, why): MET or MISSED with the comparison made, NO_TARGET for "", or
    NOT_UNDERSTOOD with the reason, never MET, for a target parse_target cannot read or
    one in another unit than the figure's."""
    if not target.strip():
        return NO_TARGET, ""
    try:
        t = parse_target(target)
    except ValueError as exc:
        return NOT_UNDERSTOOD, f"{target!r}: {exc}"
    if t.unit not in ("x", unit):
        return NOT_UNDERSTOOD, f"{target!r} is in {t.unit}, the figure in {unit}"
    if t.unit == "x":
        got, shown = ratio, f"{number(ratio)}x"
    else:
        got, shown = ours, f"{number(ours, decimals_for(unit))} {unit}"
    met = {">=": got >= t.value, ">": got > t.value, "<=": got <= t.value, "<": got < t.value,
           # 1e-9: 1.02 - 1.00 is 0.020000000000000018 in binary, and a printed 1.02 is in
           "~": abs(got - t.value) <= APPROX_REL * t.value + 1e-9}[t.op]
    return (MET if met else MISSED), f"{shown} against {target}"


def plot_line(name: str, data: dict[str, Any]) -> str:
    """`plot <name> <data as one line of JSON>`: for bench/run_all.py, not for people."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"a plot name is one word, got {name!r}")
    return f"plot {name} {json.dumps(data, separators=(',', ':'))}"


def percentile(samples: list[float], q: float) -> float:
    """The q-quantile of samples (nearest rank, q in [0, 1])."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _report(figures: list[Figure], setup: dict[str, Any]) -> dict[str, Any]:
    return {"figures": {f.name: f.as_json() for f in figures}, "setup": setup}


def write_report(path: Path, figures: list[Figure], setup: dict[str, Any]) -> None:
    """The --json report: every figure by name, and how the run was set up."""
    path.write_text(json.dumps(_report(figures, setup), indent=1) + "\n")


Run = Callable[[argparse.Namespace], tuple[list[Figure], dict[str, Any]]]


def run_main(args: argparse.Namespace, run: Run, *, printed: bool = False) -> int:
    """A bench script's main once its flags are parsed: `run(args)` measures and returns its
    figures and setup; print each figure's house line, unless `printed` (run printed them as
    they came, between its `#` lines); write the report where `args.json` says: a path, or,
    when --json is a bare flag, one line on stdout. Exit status 0: a script that cannot
    measure raises, or returns its own status before calling this."""
    figures, setup = run(args)
    if not printed:
        for figure in figures:
            print(figure.line(), flush=True)
    if args.json is True:
        print(json.dumps(_report(figures, setup)))
    elif args.json:  # a path; False or None: no report
        write_report(args.json, figures, setup)
    return 0


# --- timing ours against a baseline, interleaved ---------------------------------------------


@dataclass
class Op:
    """One thing to time: setup() (untimed) -> state; run(state) (timed); teardown(state)."""

    run: Callable[[Any], object]
    setup: Callable[[], Any] = lambda: None
    teardown: Callable[[Any], object] = lambda state: None

    def once(self) -> float:
        state = self.setup()
        start = time.perf_counter()
        self.run(state)
        elapsed = time.perf_counter() - start
        self.teardown(state)
        return elapsed


def paired(ours: Op, base: Op, repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds per run of each, warmed up, alternating which goes first."""
    for _ in range(warmup):
        ours.once()
        base.once()
    ours_s: list[float] = []
    base_s: list[float] = []
    for i in range(repeats):
        if i % 2:
            base_s.append(base.once())
            ours_s.append(ours.once())
        else:
            ours_s.append(ours.once())
            base_s.append(base.once())
    return ours_s, base_s


def gbps_figure(name: str, batch_bytes: int, ours_s: list[float], base_name: str,
                base_s: list[float], target: str = "") -> Figure:
    ours = batch_bytes / statistics.median(ours_s) / 1e9
    base = batch_bytes / statistics.median(base_s) / 1e9
    return Figure(name, ours, base_name, base, "GB/s", target=target,
                  extra={"batch_bytes": batch_bytes, "repeats": len(ours_s)})
