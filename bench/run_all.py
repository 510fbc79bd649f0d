"""`make bench`: the whole benchmark suite in one command, and a report.

Runs each bench script in turn (GPU ones only where CUDA is present), collects every
`bench <name>: <ours> <unit> vs <baseline> <unit> = <ratio>x` line it prints and every
`plot <name> <JSON>` line (the data behind a plot that the figure lines do not carry), and
writes bench/results/<date>.json (every figure and plot's data, by script, with how long each
script took and how it ended), the plots of bench/plots.py beside it as
bench/results/<date>-<plot>.png, and bench/results/<date>.md (the same as a short Markdown
report, the plots embedded, and what was left out of them and why). A script that fails or
runs past its time limit is reported as such; the others still run.

    python bench/run_all.py [--only NAME ...] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import plots

BENCH = Path(__file__).resolve().parent
LINE = re.compile(
    r"^bench (?P<name>\S+): (?P<ours>[\d.]+) (?P<unit>\S+) vs (?P<baseline_name>.+?) "
    r"(?P<baseline>[\d.]+) (?P=unit) = (?P<ratio>[\d.]+)x(?: \(target (?P<target>[^)]+)\))?$"
)
PLOT = re.compile(r"^plot (?P<name>\S+) (?P<data>\{.*\})$")


@dataclass(frozen=True)
class Script:
    name: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ("--quick",)
    timeout_s: int = 300
    gpu: bool = False
    python: str = ""
    """Another interpreter, relative to the repository (vLLM's virtualenv); "" is this one."""


SUITE = (
    Script("store_bench", timeout_s=180),
    Script("tier_bench", timeout_s=180),
    Script("l4_bench", timeout_s=180),
    Script("engine_bench", ("--baseline-requests", "2", "--ttft-reps", "2"), timeout_s=420),
    Script("engine_ttft", ("--reps", "3"), timeout_s=300),
    Script("engine_mixed", timeout_s=900),
    # Every trace family (bench/trace_families.py), the public synthetic trace among them,
    # at 1-40% of each one's distinct blocks: about a minute, the synthetic half of it.
    Script("trace_sim", ("--family", "all"), quick_args=("--family", "all", "--requests", "600"),
           timeout_s=300),
    Script("trace_sim", ("--capacities", "0.1", "--l3", "4"),  # L2 10% over an L3 4x as large
           quick_args=("--requests", "500", "--capacities", "0.1", "--l3", "4"), timeout_s=120),
    # args replace quick_args under --quick, so both name the mode.
    Script("trace_replay", ("live",), quick_args=("live", "--quick"), timeout_s=300),
    Script("index_scaling", timeout_s=180),
    Script("soak", timeout_s=600),  # without --report: docs/RELIABILITY.md is left as it is
    Script("vllm_ttft", ("--reps", "5"), timeout_s=900, python=".venv-vllm/bin/python"),
    Script("gpu_bench", quick_args=(), timeout_s=180, gpu=True),
    Script("kernel_bench", timeout_s=90, gpu=True),
)


@dataclass
class Outcome:
    script: str
    status: str  # "ok", "failed (exit N)", "timed out after N s"
    seconds: float
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    info: list[str] = field(default_factory=list)
    plots: dict[str, Any] = field(default_factory=dict)


def parse(stdout: str) -> tuple[dict[str, dict[str, Any]], list[str], dict[str, Any]]:
    """The house-format figure lines of a script's output, its `#` info lines, and the data
    of its `plot` lines (one that is not a JSON object becomes an info line instead)."""
    figures: dict[str, dict[str, Any]] = {}
    info = []
    plot_data: dict[str, Any] = {}
    for line in stdout.splitlines():
        match = LINE.match(line.strip())
        plot = PLOT.match(line.strip())
        if plot:
            try:
                plot_data[plot["name"]] = json.loads(plot["data"])
            except json.JSONDecodeError as exc:
                info.append(f"# plot {plot['name']}: not JSON ({exc.msg}), left out")
        elif match:
            f = match.groupdict()
            figures[f["name"]] = {"line": line.strip(), "ours": float(f["ours"]),
                                  "unit": f["unit"], "baseline_name": f["baseline_name"],
                                  "baseline": float(f["baseline"]), "ratio": float(f["ratio"]),
                                  "target": f["target"] or ""}
        elif line.startswith("#"):
            info.append(line)
    return figures, info, plot_data


def run_script(script: Script, quick: bool) -> Outcome:
    args = script.quick_args if quick else script.args
    python = str(BENCH.parent / script.python) if script.python else sys.executable
    if not Path(python).exists():
        return Outcome(script.name, f"skipped (no {script.python}; `make test-vllm` builds it)",
                       0.0)
    command = [python, str(BENCH / f"{script.name}.py"), *args]
    print(f"# == {script.name} {' '.join(args)}", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=script.timeout_s,
                              cwd=BENCH.parent)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        figures, info, plot_data = parse(out)
        return Outcome(script.name, f"timed out after {script.timeout_s} s",
                       time.monotonic() - start, figures, info, plot_data)
    figures, info, plot_data = parse(proc.stdout)
    status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    if proc.returncode != 0:
        info.append(f"# stderr tail: {proc.stderr.strip().splitlines()[-1:]}")
    return Outcome(script.name, status, time.monotonic() - start, figures, info, plot_data)


def markdown(outcomes: list[Outcome], stamp: str, total_s: float) -> str:
    lines = [f"# Benchmark report {stamp}", "",
             f"{len(outcomes)} scripts in {total_s / 60:.1f} min; ratio > 1 means ours is "
             "better; every baseline was measured in the same run.", "",
             "| script | status | time | figure | ours vs baseline | ratio | target |",
             "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        rows = o.figures.items() or [("-", None)]
        for name, f in rows:
            shown = "-" if f is None else (f"{f['ours']} vs {f['baseline']} {f['unit']} "
                                           f"({f['baseline_name']})")
            ratio = "-" if f is None else f"{f['ratio']:.2f}x"
            target = "" if f is None else f["target"]
            lines.append(f"| {o.script} | {o.status} | {o.seconds:.0f} s | {name} | {shown} "
                         f"| {ratio} | {target} |")
    return "\n".join(lines) + "\n"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=[s.name for s in SUITE],
                        help="run only these scripts (repeatable)")
    parser.add_argument("--quick", action="store_true", help="each script's smoke size")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    gpu = cuda_available()
    suite = [s for s in SUITE if (not args.only or s.name in args.only) and (gpu or not s.gpu)]
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    start = time.monotonic()
    outcomes = []
    for script in suite:
        outcome = run_script(script, args.quick)
        for figure in outcome.figures.values():
            print(figure["line"], flush=True)
        print(f"# {script.name}: {outcome.status} in {outcome.seconds:.0f} s", flush=True)
        outcomes.append(outcome)
    total_s = time.monotonic() - start
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": stamp, "quick": args.quick, "cuda": gpu, "total_s": total_s,
              "scripts": [asdict(o) for o in outcomes]}
    (args.out / f"{stamp}.json").write_text(json.dumps(report, indent=1) + "\n")
    drawn = plots.draw(report, args.out, stamp)
    for d in drawn:
        print(f"# plot {d.name}: {d.path if d.path else 'left out: ' + d.reason}", flush=True)
    (args.out / f"{stamp}.md").write_text(markdown(outcomes, stamp, total_s)
                                          + plots.markdown(drawn))
    print(f"# {len(outcomes)} scripts in {total_s / 60:.1f} min; report in "
          f"{args.out / (stamp + '.md')}", flush=True)
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
