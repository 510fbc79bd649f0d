"""The pictures of the benchmark report: bench/run_all.py's report (a dict, as in its JSON) in,
PNG files out, drawn headless (matplotlib's Agg canvas; no pyplot, no display).

- `hit_rate`: token hit rate against cache capacity, one panel per trace family, one curve per
  policy bench/trace_sim.py simulates (lru, store, freq_oracle, belady), from its
  `plot hit_rate_<trace>` data; runs with an L3 below L2 stay in the table only.
- `ttft`: time to first token with the prefix loaded from L2 / L3 / L4 against recomputing
  it, from the ttft_* figures of bench/engine_ttft.py and vllm_ttft_* of bench/vllm_ttft.py.
- `bandwidth`: every GB/s figure (store_bench's shared-memory and inline paths and the gRPC
  floor, tier_bench's L3, l4_bench's L4 and codec, gpu_bench's copies) against its baseline
  (memcpy, Redis, dd, the bare gRPC stream), one panel per block size.

`draw(report, out_dir, stamp)` writes `<stamp>-<plot>.png` for each plot its data allows and
returns one `Drawn` per plot: its file, what it lacks, or why it was left out (a script not
run, skipped or failed; malformed data, the script, plot and field named). It never raises
for the report it is given; `markdown(drawn)` is the report's section embedding the files.

    python bench/plots.py bench/results/<stamp>.json   # redraw beside it, refresh the .md
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DPI = 110
FONT_PT = 11
SIZE = re.compile(r"^(?P<path>.+?)_(?P<size>\d+(?:B|KiB|MiB|GiB))$")
SIZE_BYTES = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
TTFT = re.compile(r"^(?:vllm_)?ttft_(?P<tier>l\d)$")
TIER_NAMES = {"l2": "L2 (DRAM)", "l3": "L3 (NVMe)", "l4": "L4 (Redis)"}
TTFT_TITLES = {"engine_ttft": "engine_ttft: kvstore's engine",
               "vllm_ttft": "vllm_ttft: vLLM (CPU) with KVStoreConnector"}
OURS, BASE = "#1f77b4", "#9a9a9a"
POLICY_STYLES: dict[str, dict[str, Any]] = {
    "lru": {"color": "#7f7f7f", "linestyle": "--", "marker": "o"},
    "store": {"color": OURS, "linestyle": "-", "marker": "o", "linewidth": 2.6},
    "freq_oracle": {"color": "#ff7f0e", "linestyle": ":", "marker": "s"},
    "belady": {"color": "#2ca02c", "linestyle": "-.", "marker": "^"},
}
POLICY_LABELS = {"lru": "lru (plain LRU)", "store": "store (kvstore's index)",
                 "freq_oracle": "freq_oracle (offline: knows each block's uses)",
                 "belady": "belady (offline optimum)"}


class PlotDataError(ValueError):
    """Data a plot cannot use; the message names the script, the plot or figure, the field."""


@dataclass
class Drawn:
    """One plot of the report: its file, or why there is none (`reason`)."""

    name: str
    title: str
    path: Path | None = None
    reason: str = ""
    notes: list[str] = field(default_factory=list)  # what a drawn plot lacks, and why


# --- the data --------------------------------------------------------------------------------


def _scripts(report: Any) -> list[dict[str, Any]]:
    scripts = report.get("scripts") if isinstance(report, dict) else None
    if not isinstance(scripts, list) or not all(isinstance(s, dict) for s in scripts):
        raise PlotDataError("report: scripts must be a list of objects (bench/run_all.py's)")
    for n, s in enumerate(scripts):
        for key, kind in (("script", str), ("status", str), ("figures", dict)):
            if not isinstance(s.get(key), kind):
                raise PlotDataError(f"report: scripts[{n}].{key} must be a {kind.__name__}")
    return scripts


def _status_notes(report: dict[str, Any], sources: tuple[str, ...]) -> list[str]:
    """Why each source script gave nothing or less: not run, skipped, failed, timed out."""
    notes = []
    for name in sources:
        ran = [s for s in _scripts(report) if s["script"] == name]
        if not ran:
            gpu = " (no CUDA here)" if name == "gpu_bench" and not report.get("cuda") else ""
            notes.append(f"{name} not run{gpu}")
        notes += [f"{name} {s['status']}" for s in ran if s["status"] != "ok"]
    return notes


def _number(where: str, value: Any, positive: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value < 0 or (positive and value == 0)):
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise PlotDataError(f"{where} must be {want}, got {value!r}")
    return float(value)


def _numbers(where: str, value: Any, length: int, positive: bool = False) -> list[float]:
    if not isinstance(value, list) or len(value) != length:
        raise PlotDataError(f"{where} must be a list of {length} numbers, got {value!r}")
    return [_number(f"{where}[{i}]", v, positive) for i, v in enumerate(value)]


@dataclass(frozen=True)
class HitRates:
    trace: str
    family: str
    requests: int
    distinct_blocks: int
    capacities: list[str]
    pcts: list[float]
    rates: dict[str, list[float]]


def hit_rates_of(where: str, data: Any) -> HitRates:
    """One `plot hit_rate_<trace>` of bench/trace_sim.py, checked."""
    if not isinstance(data, dict):
        raise PlotDataError(f"{where} must be a JSON object")
    labels = data.get("capacities")
    if not isinstance(labels, list) or not labels or not all(isinstance(c, str) for c in labels):
        raise PlotDataError(f"{where}: capacities must be a non-empty list of labels")
    pcts = _numbers(f"{where}: capacity_pcts", data.get("capacity_pcts"), len(labels), True)
    rates = data.get("token_hit_rates")
    if not isinstance(rates, dict) or not rates:
        raise PlotDataError(f"{where}: token_hit_rates must be an object of policies")
    checked = {p: _numbers(f"{where}: token_hit_rates.{p}", r, len(labels))
               for p, r in rates.items()}
    return HitRates(str(data.get("trace", "")), str(data.get("family", "")),
                    int(_number(f"{where}: requests", data.get("requests", 0))),
                    int(_number(f"{where}: distinct_blocks", data.get("distinct_blocks", 0))),
                    labels, pcts, checked)


def hit_rate_data(report: dict[str, Any]) -> tuple[list[HitRates], list[str]]:
    """Every one-tier trace's curves (the last run of a trace wins), and notes."""
    by_trace: dict[str, HitRates] = {}
    notes = _status_notes(report, ("trace_sim",))
    for s in _scripts(report):
        plots = s.get("plots") or {}
        for name, data in (plots.items() if isinstance(plots, dict) else ()):
            if not name.startswith("hit_rate_"):
                continue
            try:
                series = hit_rates_of(f"{s['script']} plot {name}", data)
            except PlotDataError as exc:
                notes.append(f"{exc} (left out)")
                continue
            if not (isinstance(data, dict) and data.get("l3_factor")):
                by_trace[series.trace or name] = series
    return list(by_trace.values()), notes


@dataclass(frozen=True)
class Bar:
    """One figure as a pair of bars: ours against its baseline."""

    script: str
    label: str
    ours: float
    baseline: float
    baseline_name: str
    ratio: float


def _bar(script: str, name: str, label: str, f: Any) -> Bar:
    where = f"{script} figure {name}"
    if not isinstance(f, dict):
        raise PlotDataError(f"{where} must be an object")
    return Bar(script, label, _number(f"{where}: ours", f.get("ours"), True),
               _number(f"{where}: baseline", f.get("baseline"), True),
               str(f.get("baseline_name", "baseline")), _number(f"{where}: ratio", f.get("ratio")))


def ttft_data(report: dict[str, Any]) -> tuple[dict[str, list[Bar]], list[str]]:
    """TTFT from L2 / L3 / L4 against recompute, by script, tiers in order."""
    notes = _status_notes(report, tuple(TTFT_TITLES))
    out: dict[str, list[Bar]] = {}
    for s in _scripts(report):
        if s["script"] not in TTFT_TITLES:
            continue
        bars = []
        for name, f in sorted(s["figures"].items()):
            match = TTFT.match(name)
            if match and isinstance(f, dict) and f.get("unit") == "ms":
                try:
                    bars.append(_bar(s["script"], name, TIER_NAMES.get(match["tier"], name), f))
                except PlotDataError as exc:
                    notes.append(f"{exc} (left out)")
        if bars:
            out[s["script"]] = bars
    return out, notes


def bandwidth_data(report: dict[str, Any]) -> tuple[dict[str, list[Bar]], list[str]]:
    """Every GB/s figure of every script as ours vs baseline, by block size (smallest first;
    figures whose name has no size last, under "")."""
    notes = _status_notes(report, ("store_bench", "tier_bench", "l4_bench", "gpu_bench"))
    by_size: dict[str, list[Bar]] = {}
    for s in _scripts(report):
        for name, f in s["figures"].items():
            if not (isinstance(f, dict) and f.get("unit") == "GB/s"):
                continue
            match = SIZE.match(name)
            path, size = (match["path"], match["size"]) if match else (name, "")
            try:
                bar = _bar(s["script"], name, path, f)
            except PlotDataError as exc:
                notes.append(f"{exc} (left out)")
                continue
            label = f"{path} vs {bar.baseline_name}"
            by_size.setdefault(size, []).append(replace(bar, label=label))

    def size_key(size: str) -> float:
        number = re.match(r"\d+", size)
        return math.inf if number is None else int(number[0]) * SIZE_BYTES[size[number.end():]]

    return {k: by_size[k] for k in sorted(by_size, key=size_key)}, notes


# --- the pictures ----------------------------------------------------------------------------


def _figure(width_in: float, height_in: float) -> Any:
    from matplotlib.figure import Figure  # lazy: the runner imports this without matplotlib

    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    return fig


def _suptitle(fig: Any, title: str, report: dict[str, Any]) -> None:
    quick = "\n(--quick: smoke sizes, not the real figures)" if report.get("quick") else ""
    fig.suptitle(f"{title}{quick}", fontsize=FONT_PT + 3, fontweight="bold")


def _tick(label: str, pct: float) -> str:
    return label[:-3].replace("_", ".") + "%" if label.endswith("pct") else f"{pct:.2g}%"


def draw_hit_rate(series: list[HitRates], report: dict[str, Any]) -> Any:
    from matplotlib.ticker import NullLocator, PercentFormatter

    ncols = min(3, len(series))
    nrows = -(-len(series) // ncols)
    fig = _figure(4.7 * ncols + 0.4, 3.7 * nrows + 1.2)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    handles: dict[str, Any] = {}
    for ax, s in zip(axes.flat, series, strict=False):
        top = 0.0
        for policy, rates in s.rates.items():
            style = POLICY_STYLES.get(policy, {"marker": "o"})
            [line] = ax.plot(s.pcts, rates, markersize=5, **{"linewidth": 1.8, **style})
            handles.setdefault(policy, line)
            top = max(top, *rates)
        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(s.pcts, [_tick(c, p) for c, p in zip(s.capacities, s.pcts, strict=True)])
        ax.set_ylim(0, max(0.02, top * 1.12))
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0 if top > 0.2 else 1))
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{s.family or s.trace}\n{s.requests:,} requests, "
                     f"{s.distinct_blocks:,} distinct blocks", fontsize=FONT_PT)
        ax.set_xlabel("capacity (% of distinct blocks, log)", fontsize=FONT_PT)
        ax.set_ylabel("token hit rate", fontsize=FONT_PT)
        ax.tick_params(labelsize=FONT_PT - 1)
    spare = list(axes.flat)[len(series):]
    for ax in spare:
        ax.axis("off")
    labels = [POLICY_LABELS.get(p, p) for p in handles]
    if spare:
        spare[0].legend(handles.values(), labels, loc="center", fontsize=FONT_PT,
                        title="policy (bench/sim_policies.py)", title_fontsize=FONT_PT)
    else:
        fig.legend(handles.values(), labels, loc="outside lower center", ncols=len(labels),
                   fontsize=FONT_PT)
    _suptitle(fig, "Token hit rate vs cache capacity, per trace family (bench/trace_sim.py)",
              report)
    return fig


def _label_bars(ax: Any, bars: Any, texts: list[str], horizontal: bool) -> None:
    ax.bar_label(bars, texts, padding=3, fontsize=FONT_PT - 1)
    if not horizontal:
        ax.margins(y=0.18)


def _speedup(ratio: float) -> str:
    """A TTFT ratio (recompute / ours) in words."""
    if ratio >= 1:
        return f"{ratio:.1f}x faster"
    return f"{1 / ratio:.1f}x slower" if ratio > 0 else "no ratio"


def draw_ttft(by_script: dict[str, list[Bar]], report: dict[str, Any]) -> Any:
    fig = _figure(max(8.5, 5.6 * len(by_script) + 0.6), 5.4)
    axes = fig.subplots(1, len(by_script), squeeze=False)[0]
    for ax, (script, bars) in zip(axes, by_script.items(), strict=True):
        x = list(range(len(bars)))
        ours = ax.bar([i - 0.2 for i in x], [b.ours for b in bars], 0.38, color=OURS,
                      label="prefix loaded from the store")
        base = ax.bar([i + 0.2 for i in x], [b.baseline for b in bars], 0.38, color=BASE,
                      label="recompute (no store, no prefix cache)")
        _label_bars(ax, ours, [f"{b.ours:,.0f} ms\n{_speedup(b.ratio)}" for b in bars], False)
        _label_bars(ax, base, [f"{b.baseline:,.0f} ms" for b in bars], False)
        ax.set_xticks(x, [b.label for b in bars], fontsize=FONT_PT)
        ax.set_ylabel("TTFT, median (ms; lower is better)", fontsize=FONT_PT)
        ax.set_title(TTFT_TITLES.get(script, script), fontsize=FONT_PT + 1)
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(labelsize=FONT_PT - 1)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2,
               fontsize=FONT_PT)
    _suptitle(fig, "Time to first token: the prefix from L2 / L3 / L4 vs recomputing it",
              report)
    return fig


def draw_bandwidth(by_size: dict[str, list[Bar]], report: dict[str, Any]) -> Any:
    rows = sum(len(b) for b in by_size.values())
    fig = _figure(11.5, 1.6 + 0.58 * rows + 0.55 * len(by_size))
    axes = fig.subplots(len(by_size), 1, squeeze=False, sharex=True,
                        height_ratios=[len(b) + 1 for b in by_size.values()])[:, 0]
    values = [v for bars in by_size.values() for b in bars for v in (b.ours, b.baseline)]
    log = max(values) / min(values) > 20
    for ax, (size, bars) in zip(axes, by_size.items(), strict=True):
        y = list(range(len(bars)))
        ours = ax.barh([i - 0.2 for i in y], [b.ours for b in bars], 0.38, color=OURS,
                       label="ours (kvstore)")
        base = ax.barh([i + 0.2 for i in y], [b.baseline for b in bars], 0.38, color=BASE,
                       label="its baseline (named on the left)")
        _label_bars(ax, ours, [f"{b.ours:.2f} GB/s ({b.ratio:.2f}x)" for b in bars], True)
        _label_bars(ax, base, [f"{b.baseline:.2f}" for b in bars], True)
        ax.set_yticks(y, [b.label for b in bars], fontsize=FONT_PT - 1)
        ax.invert_yaxis()
        ax.set_title(f"{size.replace('KiB', ' KiB').replace('MiB', ' MiB')} blocks" if size
                     else "no block size in the figure's name", fontsize=FONT_PT + 1, loc="left")
        ax.grid(True, axis="x", alpha=0.3)
        ax.tick_params(labelsize=FONT_PT - 1)
    if log:
        from matplotlib.ticker import FuncFormatter, LogLocator

        axes[0].set_xscale("log")
        axes[0].xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes[0].xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].set_xlim(min(values) / 1.5 if log else 0, max(values) * (3 if log else 1.35))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2,
               fontsize=FONT_PT)
    axes[-1].set_xlabel(f"GB/s{' (log scale)' if log else ''}; higher is better; "
                        "(ratio) = ours / baseline", fontsize=FONT_PT)
    _suptitle(fig, "Bandwidth of each path vs memcpy and its baselines", report)
    return fig


# --- the report ------------------------------------------------------------------------------

Collect = Callable[[dict[str, Any]], tuple[Any, list[str]]]
Render = Callable[[Any, dict[str, Any]], Any]
PLOTS: tuple[tuple[str, str, Collect, Render], ...] = (
    ("hit_rate", "Token hit rate vs capacity, per trace family", hit_rate_data, draw_hit_rate),
    ("ttft", "TTFT with the prefix from L2 / L3 / L4 vs recompute", ttft_data, draw_ttft),
    ("bandwidth", "Bandwidth of each path vs memcpy and its baselines", bandwidth_data,
     draw_bandwidth),
)


def draw(report: Any, out_dir: Path, stamp: str) -> list[Drawn]:
    """Each plot the report's data allows, as out_dir/<stamp>-<name>.png; never raises."""
    drawn = [Drawn(name, title) for name, title, _, _ in PLOTS]
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        for d in drawn:
            d.reason = f"matplotlib is not installed ({exc}): pip install -e '.[test]'"
        return drawn
    for d, (name, _, collect, render) in zip(drawn, PLOTS, strict=True):
        try:
            data, d.notes = collect(report)
            if not data:
                d.reason = "no data: " + ("; ".join(d.notes) or "no such figures in the report")
                d.notes = []
                continue
            fig = render(data, report)
            path = out_dir / f"{stamp}-{name}.png"
            fig.savefig(path, dpi=DPI)
            d.path = path
        except PlotDataError as exc:
            d.reason = f"bad data: {exc}"
        except Exception as exc:  # a plot that cannot be drawn is left out, not the report
            d.reason = f"drawing failed: {type(exc).__name__}: {exc}"
    return drawn


def markdown(drawn: list[Drawn]) -> str:
    """The report's `## Plots` section: each file embedded, what it lacks; what was not drawn."""
    lines = ["", "## Plots", ""]
    for d in drawn:
        if d.path is None:
            continue
        lines += [f"### {d.title}", "", f"![{d.title}]({d.path.name})", ""]
        if d.notes:
            lines += ["Not in it: " + "; ".join(d.notes) + ".", ""]
    left_out = [d for d in drawn if d.path is None]
    if left_out:
        lines += ["Not drawn:", ""] + [f"- {d.title}: {d.reason}" for d in left_out] + [""]
    return "\n".join(lines)


def refresh_markdown(md_path: Path, section: str) -> None:
    """Replace the report's `## Plots` section (everything from it on), or add it."""
    text = md_path.read_text()
    head, found, _ = text.partition("\n## Plots\n")
    md_path.write_text((head if found else text.rstrip("\n") + "\n") + section)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        report = json.loads(path.read_text())
        _scripts(report)
    except (OSError, json.JSONDecodeError, PlotDataError) as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 2
    drawn = draw(report, path.parent, path.stem)
    for d in drawn:
        print(f"# plot {d.name}: {d.path if d.path else 'left out: ' + d.reason}")
    md_path = path.with_suffix(".md")
    if md_path.exists():
        refresh_markdown(md_path, markdown(drawn))
        print(f"# {md_path}: plots section refreshed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
