"""`make bench`: the whole benchmark suite in one command, and a report.

Runs each bench script in turn (GPU ones only where CUDA is present), collects every
`bench <name>: <ours> <unit> vs <baseline> <unit> = <ratio>x` line it prints and every
`plot <name> <JSON>` line (the data behind a plot that the figure lines do not carry), and
writes bench/results/<date>.json (every figure and plot's data, by script, with how long each
script took and how it ended), the plots of bench/plots.py beside it as
bench/results/<date>-<plot>.png, and bench/results/<date>.md (the same as a short Markdown
report, the plots embedded, and what was left out of them and why). A script that fails or
runs past its time limit is reported as such; the others still run.

Each script's own output is kept too, in bench/results/<date>/: what it printed on stdout
(<script>.out) and on stderr (<script>.err), and its own JSON report (<script>.json, asked for
with --json), which holds more than its figure lines: its set-up and per-rep details. A script
run twice gets <script>-2.* the second time. The report names these files for each script
(stdout_file, stderr_file and json_file, relative to the report's folder; "" when there is
none), so a failed script's whole output can be read, and the smoke tests
(tests/e2e/conftest.py) read one quick run's files instead of running each script again.

Each figure with a target (the `(target ...)` at the end of its line) is judged against it,
on the numbers as printed (bench/figures.py `judge`): "met", "missed", or "target not
understood" (a target the runner cannot read is never counted as met); a figure without one is
"no target". The Markdown has a verdict column, the JSON each figure's "verdict" and "why",
and the runner's stdout names every figure that missed. A --quick run measures at smoke sizes,
where a target means little: its figures are judged all the same, for the reader, but the exit
status counts them only with --strict.

Exit status:
  0  every script ran and ended ok, and no figure missed its target (or the run was --quick
     without --strict);
  1  a script failed, ran past its time limit or was skipped (its interpreter is missing),
     whatever the targets said;
  2  the command line was wrong (argparse);
  3  every script ended ok, but a figure missed its target or has a target the runner does not
     understand (a full run, or a --quick run with --strict).

By default the scripts run one at a time, each alone on the machine, as a measurement wants.
--jobs N runs up to N at once (each still in suite order of starting, the report in suite
order): for a run that checks the scripts rather than measures, such as the test suite's one
quick run (tests/e2e/bench_run.py), which otherwise kept a core idle while tests waited on it.

    python bench/run_all.py [--only NAME ...] [--quick] [--strict] [--jobs N] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import plots
from figures import MISSED, NOT_UNDERSTOOD, decimals_for, judge, number

BENCH = Path(__file__).resolve().parent
LINE = re.compile(
    r"^bench (?P<name>\S+): (?P<ours>[\d.]+) (?P<unit>\S+) vs (?P<baseline_name>.+?) "
    r"(?P<baseline>[\d.]+) (?P=unit) = (?P<ratio>[\d.]+)x(?: \(target (?P<target>[^)]+)\))?$"
)
PLOT = re.compile(r"^plot (?P<name>\S+) (?P<data>\{.*\})$")

EXIT_OK, EXIT_SCRIPT_FAILED, EXIT_TARGET_MISSED = 0, 1, 3
"""The runner's exit status (2 is argparse's, for a wrong command line): the module's
docstring says when each is returned."""


@dataclass(frozen=True)
class Script:
    name: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ("--quick",)
    timeout_s: int = 300
    gpu: bool = False
    python: str = ""
    """Another interpreter, relative to the repository (vLLM's virtualenv); "" is this one."""
    json: Literal["path", "stdout"] = "path"
    """How the script hands over its JSON report: "path" (`--json PATH` writes it there) or
    "stdout" (a bare `--json` prints it as the last line of stdout)."""
    source: str = ""
    """The script's file, relative to the repository (or absolute); "" is bench/<name>.py."""


SUITE = (
    Script("store_bench", timeout_s=180, json="stdout"),
    Script("tier_bench", timeout_s=180),
    Script("l3_pressure", ("--busy",), quick_args=("--quick", "--busy"), timeout_s=300),
    Script("l4_bench", timeout_s=180),
    Script("remote_bench", timeout_s=180),
    # Their limits are the smoke tests' old ones: on a busy 2-core machine even --quick took
    # 220 s (engine_bench) and 45 s (engine_ttft) with the rest of the suite beside it.
    Script("engine_bench", ("--baseline-requests", "2", "--ttft-reps", "2"), timeout_s=900),
    Script("engine_ttft", ("--reps", "3"), timeout_s=400),
    Script("engine_mixed", timeout_s=900),
    # The store codecs' quality and bytes on SmolLM2 (docs/codecs.md): about 2 minutes here.
    Script("codec_quality", timeout_s=600),
    # Every trace family (bench/trace_families.py), the public synthetic trace among them,
    # at 1-40% of each one's distinct blocks: about a minute, the synthetic half of it.
    Script("trace_sim", ("--family", "all"), quick_args=("--family", "all", "--requests", "600"),
           timeout_s=300),
    Script("trace_sim", ("--capacities", "0.1", "--l3", "4"),  # L2 10% over an L3 4x as large
           quick_args=("--requests", "500", "--capacities", "0.1", "--l3", "4"), timeout_s=120),
    # Routing policies over 4, 16 and 64 replicas sharing one L4, with lambda and utilization
    # sweeps at 16: about 2 min on one core; --quick (600 requests, N = 4, 16) about 6 s.
    Script("fleet_sim", timeout_s=300),
    # args replace quick_args under --quick, so both name the mode.
    Script("trace_replay", ("live",), quick_args=("live", "--quick"), timeout_s=300),
    Script("index_scaling", timeout_s=180),
    Script("soak", timeout_s=600),  # without --report: docs/RELIABILITY.md is left as it is
    Script("vllm_ttft", ("--reps", "5"), timeout_s=900, python=".venv-vllm/bin/python"),
    Script("gpu_bench", quick_args=(), timeout_s=180, gpu=True, json="stdout"),
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
    stdout_file: str = ""
    stderr_file: str = ""
    json_file: str = ""


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
            ours, ratio, target = float(f["ours"]), float(f["ratio"]), f["target"] or ""
            verdict, why = judge(target, ours, ratio, f["unit"])
            figures[f["name"]] = {"line": line.strip(), "ours": ours, "unit": f["unit"],
                                  "baseline_name": f["baseline_name"],
                                  "baseline": float(f["baseline"]), "ratio": ratio,
                                  "target": target, "verdict": verdict, "why": why}
        elif line.startswith("#"):
            info.append(line)
    return figures, info, plot_data


def run_script(script: Script, quick: bool, files: Path | None = None) -> Outcome:
    """Run one script and parse what it printed. With `files` (a path without a suffix, such
    as results/<date>/store_bench) the script is asked for its JSON report, and its stdout,
    stderr and that report are kept as files.out, files.err and files.json; the outcome names
    them relative to the report's folder (results/, two levels up from files)."""
    args = script.quick_args if quick else script.args
    python = str(BENCH.parent / script.python) if script.python else sys.executable
    if not Path(python).exists():
        return Outcome(script.name, f"skipped (no {script.python}; `make test-vllm` builds it)",
                       0.0)
    json_args: tuple[str, ...] = ()
    if files is not None:
        files.parent.mkdir(parents=True, exist_ok=True)
        json_args = ("--json",) if script.json == "stdout" else ("--json", str(_json(files)))
    source = BENCH.parent / script.source if script.source else BENCH / f"{script.name}.py"
    command = [python, str(source), *args, *json_args]
    print(f"# == {script.name} {' '.join(args)}", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=script.timeout_s,
                              cwd=BENCH.parent)
    except subprocess.TimeoutExpired as exc:
        out, err = _text(exc.stdout), _text(exc.stderr)
        outcome = Outcome(script.name, f"timed out after {script.timeout_s} s",
                          time.monotonic() - start, *parse(out))
    else:
        out, err = proc.stdout, proc.stderr
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        outcome = Outcome(script.name, status, time.monotonic() - start, *parse(out))
        if proc.returncode != 0:
            outcome.info.append(f"# stderr tail: {err.strip().splitlines()[-1:]}")
    if files is not None:
        _keep(outcome, files, out, err, stdout_json=script.json == "stdout")
    return outcome


def _text(captured: str | bytes | None) -> str:
    """What a timed-out run had printed (subprocess hands it over as bytes, or not at all)."""
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured or ""


def _json(files: Path) -> Path:
    return files.with_name(files.name + ".json")


def _keep(outcome: Outcome, files: Path, out: str, err: str, stdout_json: bool) -> None:
    """Write a script's stdout and stderr beside the report, and its JSON report when it
    printed one as its last stdout line; name in the outcome the files there are."""
    written = {"stdout_file": files.with_name(files.name + ".out"),
               "stderr_file": files.with_name(files.name + ".err")}
    written["stdout_file"].write_text(out)
    written["stderr_file"].write_text(err)
    if stdout_json:
        last = out.rstrip("\n").rpartition("\n")[2]
        try:
            report = json.loads(last)
        except json.JSONDecodeError:
            report = None
        if isinstance(report, dict):
            _json(files).write_text(json.dumps(report, indent=1) + "\n")
        else:
            outcome.info.append("# no JSON report: its last stdout line is not a JSON object")
    if _json(files).exists():
        written["json_file"] = _json(files)
    for name, path in written.items():
        setattr(outcome, name, str(path.relative_to(files.parent.parent)))


def files_of(suite: list[Script], folder: Path) -> list[Path]:
    """Where each script's own files go: folder/<script>, then folder/<script>-2 for a second
    run of the same script, and so on."""
    seen: dict[str, int] = {}
    paths = []
    for script in suite:
        seen[script.name] = seen.get(script.name, 0) + 1
        suffix = "" if seen[script.name] == 1 else f"-{seen[script.name]}"
        paths.append(folder / f"{script.name}{suffix}")
    return paths


def unmet(outcomes: list[Outcome]) -> list[tuple[str, str, dict[str, Any]]]:
    """(script, figure, figure's entry) for each figure that missed its target or whose
    target the runner does not understand, in the order they ran."""
    return [(o.script, name, f) for o in outcomes for name, f in o.figures.items()
            if verdict_of(f)[0] in (MISSED, NOT_UNDERSTOOD)]


def verdict_of(figure: dict[str, Any]) -> tuple[str, str]:
    """A parsed figure's (verdict, why); judged here for a report saved before the runner
    judged its figures."""
    if "verdict" in figure:
        return figure["verdict"], figure["why"]
    return judge(figure["target"], figure["ours"], figure["ratio"], figure["unit"])


def exit_status(outcomes: list[Outcome], quick: bool, strict: bool) -> int:
    """The runner's exit status (the module's docstring says which and why)."""
    if not all(o.status == "ok" for o in outcomes):
        return EXIT_SCRIPT_FAILED
    if unmet(outcomes) and (strict or not quick):
        return EXIT_TARGET_MISSED
    return EXIT_OK


def markdown(outcomes: list[Outcome], stamp: str, total_s: float, quick: bool = False,
             strict: bool = False) -> str:
    """The report's table: a row per figure (a row with "-" for a script that printed none),
    each figure judged against its target."""
    lines = [f"# Benchmark report {stamp}", "",
             f"{len(outcomes)} scripts in {total_s / 60:.1f} min; ratio > 1 means ours is "
             "better; every baseline was measured in the same run.", ""]
    missed = unmet(outcomes)
    if missed:
        judged = ("the exit status counts them (--strict)" if strict else
                  "a --quick run measures at smoke sizes, so the exit status does not count "
                  "them (--strict would)") if quick else (
                      "so the run's exit status is 3, or 1 if a script also failed")
        lines += ["; ".join(_summary(missed)) + f"; {judged}.", ""]
    lines += ["| script | status | time | figure | ours vs baseline | ratio | target | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        rows = o.figures.items() or [("-", None)]
        for name, f in rows:
            if f is None:
                lines.append(f"| {o.script} | {o.status} | {o.seconds:.0f} s | - | - | - | | |")
                continue
            decimals = decimals_for(f["unit"])
            shown = (f"{number(f['ours'], decimals)} vs {number(f['baseline'], decimals)} "
                     f"{f['unit']} ({f['baseline_name']})")
            verdict, why = verdict_of(f)
            if verdict == NOT_UNDERSTOOD:
                verdict = f"{verdict}: {why}".replace("|", "\\|")
            target = f["target"].replace("|", "\\|")  # a cell of its own, whatever it says
            lines.append(f"| {o.script} | {o.status} | {o.seconds:.0f} s | {name} | {shown} "
                         f"| {number(f['ratio'])}x | {target} | {verdict} |")
    return "\n".join(lines) + "\n"


def _summary(unmet_figures: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """The report's sentence parts naming the figures that missed and those whose target the
    runner could not read, each part only when there are some."""
    parts = []
    for verdict, one, many in ((MISSED, "1 figure missed its target",
                                "{n} figures missed their targets"),
                               (NOT_UNDERSTOOD, "1 figure has a target the runner does not "
                                "understand", "{n} figures have targets the runner does not "
                                "understand")):
        names = [name for _, name, f in unmet_figures if verdict_of(f)[0] == verdict]
        if names:
            count = one if len(names) == 1 else many.format(n=len(names))
            parts.append(f"**{count}**: {', '.join(names)}")
    return parts


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
    parser.add_argument("--quick", action="store_true",
                        help="each script's smoke size; its targets are judged but do not "
                             "count in the exit status unless --strict")
    parser.add_argument("--strict", action="store_true",
                        help="with --quick: exit 3 when a figure missed its target, as a "
                             "full run does")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run up to N scripts at once (default 1: each alone; more for "
                             "a run that checks the scripts rather than measures)")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    gpu = cuda_available()
    suite = [s for s in SUITE if (not args.only or s.name in args.only) and (gpu or not s.gpu)]
    return run_suite(suite, args.quick, args.strict, args.out, gpu, args.jobs)


def run_suite(suite: list[Script], quick: bool, strict: bool, out: Path,
              gpu: bool = False, jobs: int = 1) -> int:
    """Run the scripts, up to `jobs` at once (started in suite order; each one's figure lines
    print as it ends), write the JSON and Markdown reports (in suite order) and the plots
    under out, and return the runner's exit status."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running = [pool.submit(run_script, script, quick, files)
                   for script, files in zip(suite, files_of(suite, out / stamp), strict=True)]
        for done in as_completed(running):
            outcome = done.result()
            for figure in outcome.figures.values():
                print(figure["line"], flush=True)
            print(f"# {outcome.script}: {outcome.status} in {outcome.seconds:.0f} s",
                  flush=True)
        outcomes = [run.result() for run in running]
    total_s = time.monotonic() - start
    status = exit_status(outcomes, quick, strict)
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": stamp, "quick": quick, "strict": strict, "cuda": gpu, "total_s": total_s,
              "exit_status": status, "scripts": [asdict(o) for o in outcomes]}
    (out / f"{stamp}.json").write_text(json.dumps(report, indent=1) + "\n")
    drawn = plots.draw(report, out, stamp)
    for d in drawn:
        print(f"# plot {d.name}: {d.path if d.path else 'left out: ' + d.reason}", flush=True)
    (out / f"{stamp}.md").write_text(markdown(outcomes, stamp, total_s, quick, strict)
                                     + plots.markdown(drawn))
    for script_name, name, f in unmet(outcomes):
        print(f"# {': '.join(verdict_of(f))}: {script_name} {name}", flush=True)
    print(f"# {len(outcomes)} scripts in {total_s / 60:.1f} min; report in "
          f"{out / (stamp + '.md')}; exit status {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
