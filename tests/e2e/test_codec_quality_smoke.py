"""bench/codec_quality.py runs end to end: `--quick --json PATH` (in the session's shared run of
bench/run_all.py, tests/e2e/bench_run.py) stores SmolLM2's prompt blocks through each codec
in a real daemon, loads them into a fresh engine and generates; it prints one `bench <name>:
... = <ratio>x` line per figure and writes the same figures as JSON. What is checked is what
each figure claims to measure (every prompt's blocks came from the store, `none` through the
store is the computed run exactly, the bytes are the codecs' layouts, the TTFT reps loaded
from L4), never the quality or the speed: the targets live in the bench."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from tests.e2e.bench_run import BenchRun
from tests.e2e.house_format import check_report, printed_figures

pytestmark = [pytest.mark.slow, pytest.mark.bench("codec_quality")]

# SmolLM2-135M's block: 30 layers x K/V x 16 tokens x 3 heads x 64, in bfloat16.
BF16_BLOCK = 30 * 2 * 16 * 3 * 64 * 2


def test_codec_quality_quick_json(bench_run: BenchRun) -> None:
    run = bench_run.script("codec_quality")
    run.assert_ok()
    for line in run.lines:
        assert line.startswith(("bench ", "#")), f"neither a figure nor an info line: {line!r}"
    lossless = ["lz4_shuffle2", "lz4_exponent_plane"]
    if importlib.util.find_spec("zstandard") is not None:
        lossless += ["zstd1_exponent_plane", "zstd3_exponent_plane"]
    expected = {"codec_none_greedy_agreement", "codec_none_perplexity"}
    for codec in ("fp8", "int4"):
        expected |= {f"codec_{codec}_{f}" for f in ("greedy_agreement", "perplexity",
                                                    "bytes_vs_bf16", "bytes_vs_float32",
                                                    "encode", "decode")}
    expected |= {f"lossless_{s}_{f}" for s in lossless for f in ("bytes", "encode")}
    expected.add("codec_fp8_ttft_l3")  # the prefix in L3 only: a daemon's file, no Redis
    if shutil.which("redis-server") is not None:
        expected.add("codec_fp8_ttft_l4")
    report = run.report
    figures = report["figures"]
    check_report(figures, printed_figures(run.lines), expected)

    # Raw blocks through the store give the computed run's tokens and perplexity.
    assert figures["codec_none_greedy_agreement"]["ours"] == 100.0
    assert abs(figures["codec_none_perplexity"]["ratio"] - 1.0) < 1e-3
    # The bytes are the layouts' (docs/codecs.md): fp8 65 bytes per 64 values, int4 32 bytes
    # of codes per 64 values plus float16 scale and zero per key channel and 32 value channels.
    fp8 = figures["codec_fp8_bytes_vs_bf16"]
    assert fp8["block_bytes"] == 16 + 30 * 2 * 16 * 3 * 65 and fp8["raw_bytes"] == BF16_BLOCK
    int4 = figures["codec_int4_bytes_vs_bf16"]
    assert int4["block_bytes"] == 16 + 30 * 192 * 4 + 30 * 16 * 3 * 2 * 4 + 30 * 2 * 16 * 96
    for figure in (fp8, int4):
        assert figure["ratio"] == pytest.approx(figure["raw_bytes"] / figure["block_bytes"])
    assert fp8["target"] == ">= 1.9x" and int4["target"] == ">= 3.5x"
    assert figures["codec_fp8_bytes_vs_float32"]["ratio"] == pytest.approx(2 * fp8["ratio"])
    # Every prompt's full blocks (but the last token's) came from the store, for every codec.
    setup = report["setup"]
    assert set(setup["codecs"]) == {"none", "fp8", "int4"}
    loaded = {name: c["loaded_prompt_tokens"] for name, c in setup["codecs"].items()}
    assert loaded["fp8"] == loaded["int4"] == loaded["none"]
    assert all(tokens >= 48 and tokens % 16 == 0 for tokens in loaded["none"])
    if "codec_fp8_ttft_l4" in expected:  # every timed rep loaded the whole prefix from L4
        runs = figures["codec_fp8_ttft_l4"]["runs_ms"]
        assert set(runs) == {"none", "fp8"} and len(runs["none"]) == len(runs["fp8"]) >= 2
