"""The house format of every benchmark figure: one line
`bench <name>: <ours> <unit> vs <baseline> <unit> = <ratio>x`, the same as JSON, and the end of
every bench script's main (`run_main`); the data behind a plot that the figure lines do not
carry, as one line `plot <name> <compact JSON object>` (`plot_line`; bench/run_all.py keeps
it in the report, bench/plots.py draws it); and the timing of ours against a baseline, repeat
by repeat (`Op`, `paired`, `gbps_figure`)."""

from __future__ import annotations

import argparse
import json
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
        digits = 3 if self.unit == "ms" else 2
        target = f" (target {self.target})" if self.target else ""
        return (f"bench {self.name}: {self.ours:.{digits}f} {self.unit} vs {self.baseline_name} "
                f"{self.baseline:.{digits}f} {self.unit} = {self.ratio:.2f}x{target}")

    def as_json(self) -> dict[str, Any]:
        return {"ours": self.ours, "baseline_name": self.baseline_name,
                "baseline": self.baseline, "unit": self.unit, "ratio": self.ratio,
                "target": self.target, **self.extra}


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
