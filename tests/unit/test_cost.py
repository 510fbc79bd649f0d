"""kvstore.integrations.cost: the prefill fit recovers known coefficients, tier rates follow
their sources and age out, and decide picks the cut that a brute force over every k picks."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvstore.integrations.cost import (
    MIN_STATS_DELTA_BYTES,
    PENDING_BYTES_PER_S,
    Decision,
    PrefillModel,
    TierRates,
    decide,
    slowest,
)

# A plausible 8B model on one GPU: 20k tokens/s of linear work, attention on top, 5 ms a step.
A, B, C = 5e-5, 2e-9, 5e-3
STEP = 2048
BLOCK = 16
BLOCK_BYTES = 2 * 1024 * 1024  # 16 tokens x 128 KiB


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def true_seconds(chunks: list[tuple[int, int]], a: float = A, b: float = B,
                 c: float = C) -> float:
    tokens = sum(n for n, _ in chunks)
    attention = sum(n * (ctx + n / 2) for n, ctx in chunks)
    return a * tokens + b * attention + c


def random_step(rng: random.Random) -> list[tuple[int, int]]:
    """An engine step: some decodes, sometimes a prefill chunk next to them."""
    chunks = [(1, rng.randrange(10, 32_000)) for _ in range(rng.randrange(0, 48))]
    if rng.random() < 0.4 or not chunks:
        chunks.append((rng.randrange(16, STEP + 1), rng.randrange(0, 30_000)))
    return chunks


def fitted(steps: int = 256, seed: int = 0, noise: float = 0.0, scale: float = 1.0,
           model: PrefillModel | None = None) -> PrefillModel:
    rng = random.Random(seed)
    model = model or PrefillModel()
    for _ in range(steps):
        chunks = random_step(rng)
        t = scale * true_seconds(chunks) * (1 + rng.gauss(0, noise))
        model.observe(chunks, t)
    return model


def chunked_truth(tokens: int, context: int, step: int, scale: float = 1.0) -> float:
    """The prefill as the engine would run it, chunk by chunk."""
    total, done = 0.0, 0
    while done < tokens:
        n = min(step, tokens - done)
        total += true_seconds([(n, context + done)])
        done += n
    return scale * total


# PrefillModel


def test_recovers_the_coefficients_exactly_without_noise() -> None:
    coef = fitted().coefficients
    assert coef is not None
    for got, want in zip(coef, (A, B, C), strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_predicts_a_long_prefill_within_a_few_percent_under_noise() -> None:
    model = fitted(noise=0.05, seed=1)
    for tokens, context in ((32_768, 0), (8_000, 24_000), (2_048, 0), (100, 5_000)):
        got = model.estimate(tokens, context, STEP)
        assert got == pytest.approx(chunked_truth(tokens, context, STEP), rel=0.03)


def test_the_estimate_is_the_chunk_by_chunk_sum() -> None:
    model = fitted()
    for tokens, context, step in ((5_000, 300, 2048), (4_096, 0, 4_096), (17, 9, 4)):
        assert model.estimate(tokens, context, step) == pytest.approx(
            chunked_truth(tokens, context, step), rel=1e-6)
    # one more step of the same work costs exactly c
    one, two = model.estimate(4_096, 0, 4_096), model.estimate(4_096, 0, 2_048)
    assert one is not None and two is not None
    assert two - one == pytest.approx(C, rel=1e-6)
    assert model.estimate(0, 100, STEP) == 0.0
    assert model.estimate(-5, 100, STEP) == 0.0


def test_none_before_three_steps() -> None:
    model = PrefillModel()
    for i in range(2):
        model.observe([(512, 0)], true_seconds([(512, 0)]))
        assert model.estimate(512, 0, STEP) is None
        assert model.steps == i + 1
    model.observe([(256, 100)], true_seconds([(256, 100)]))
    assert model.estimate(512, 0, STEP) is not None


def test_decodes_alone_do_not_extrapolate_to_a_long_prefill() -> None:
    model = PrefillModel()
    rng = random.Random(2)
    for _ in range(100):
        chunks = [(1, rng.randrange(100, 8_000)) for _ in range(rng.randrange(1, 64))]
        model.observe(chunks, true_seconds(chunks))
    assert model.estimate(2_048, 0, STEP) is None
    assert model.estimate(4_000, 0, 128) is not None  # steps of 63 tokens seen >= 128 // 4
    assert model.estimate(200, 0, STEP) is not None  # a short suffix: 50 tokens, seen
    model.observe([(600, 0)], true_seconds([(600, 0)]))
    assert model.estimate(2_048, 0, STEP) is not None  # 600 >= 2048 // 4


def test_empty_and_timeless_steps_are_ignored() -> None:
    model = PrefillModel()
    model.observe([], 0.1)
    model.observe([(0, 100)], 0.1)
    model.observe([(100, 0)], 0.0)
    model.observe([(100, 0)], -1.0)
    model.observe([(100, 0)], math.nan)
    assert model.steps == 0
    with pytest.raises(ValueError, match="chunks"):
        model.observe([(-1, 0)], 0.1)
    with pytest.raises(ValueError, match="window"):
        PrefillModel(window=2)
    with pytest.raises(ValueError, match="step_tokens"):
        model.estimate(10, 0, 0)


def test_a_coefficient_that_would_come_out_negative_is_held_at_zero() -> None:
    # seconds = a*tokens - 1 ms: the unconstrained fit wants c < 0
    model = PrefillModel()
    for n in range(100, 2_000, 100):
        model.observe([(n, 0)], A * n - 1e-3)
    coef = model.coefficients
    assert coef is not None
    assert min(coef) >= 0.0
    assert coef[2] == 0.0
    got = model.estimate(1_000, 0, STEP)
    assert got is not None and got == pytest.approx(A * 1_000 - 1e-3, rel=0.05)


def test_forgets_steps_past_the_window_and_converges_to_a_new_speed() -> None:
    model = fitted(steps=300)
    old = chunked_truth(32_768, 0, STEP)
    assert model.estimate(32_768, 0, STEP) == pytest.approx(old, rel=1e-6)
    fitted(steps=128, seed=3, scale=2.0, model=model)  # the GPU is now shared: half the speed
    halfway = model.estimate(32_768, 0, STEP)
    assert halfway is not None and old * 1.2 < halfway < old * 1.8
    fitted(steps=128, seed=4, scale=2.0, model=model)
    assert model.steps == 256
    assert model.estimate(32_768, 0, STEP) == pytest.approx(2 * old, rel=1e-6)


def test_a_long_spell_of_decodes_does_not_forget_what_a_prefill_costs() -> None:
    model = fitted(steps=64)
    want = chunked_truth(8_192, 0, STEP)
    rng = random.Random(9)
    for _ in range(1_000):  # decodes only: one new token per sequence
        chunks = [(1, rng.randrange(16, 4_096)) for _ in range(rng.randrange(1, 33))]
        model.observe(chunks, true_seconds(chunks))
    # The window, and up to window/32 = 8 older steps of each size (power of two) larger than
    # its largest (decodes of up to 32 sequences: 2^5), up to the largest prefill (2^11 + 47).
    assert 256 < model.steps <= 256 + 8 * (12 - 6 + 1)
    got = model.estimate(8_192, 0, STEP)
    assert got is not None and got == pytest.approx(want, rel=1e-6)
    plain = PrefillModel(window=256)
    for _ in range(300):
        chunks = [(1, rng.randrange(16, 4_096)) for _ in range(8)]
        plain.observe(chunks, true_seconds(chunks))
    assert plain.estimate(8_192, 0, STEP) is None  # never saw a prefill: does not guess


def test_short_chunks_beside_decodes_do_not_make_it_forget_a_long_prefill() -> None:
    # The mixed benchmark's shape: after the long prefills, every step is 8 decodes and an
    # arrival's 4 fresh tokens (a prefill chunk, but a short one). Keeping only the last
    # prefill steps forgot the long ones after 32 arrivals: "no estimate yet" for 235 of 282.
    model = PrefillModel()
    for n in (256, 512, 1_024, 2_048):
        model.observe([(n, 0)], true_seconds([(n, 0)]))
    rng = random.Random(11)
    for _ in range(1_000):
        chunks = [(1, rng.randrange(16, 2_048)) for _ in range(8)] + [(4, 1_024)]
        model.observe(chunks, true_seconds(chunks))
    got = model.estimate(1_028, 0, STEP)
    assert got is not None and got == pytest.approx(chunked_truth(1_028, 0, STEP), rel=1e-6)
    assert model.steps == 256 + 4  # the window, and the four long steps it no longer holds
    model.observe([(2_048, 0)], 2 * true_seconds([(2_048, 0)]))  # a size the window holds now
    assert model.steps == 256


# TierRates


def test_nothing_known_is_none_and_pending_is_never_none() -> None:
    rates = TierRates(clock=FakeClock())
    for tier in ("hbm", "dram", "nvme", "remote", "tape"):
        assert rates.estimate(tier, 1 << 20) is None
    rates.observe_rtt(0.01)
    rates.observe_load("pending", 1 << 20, 5.0)  # not learnt
    assert rates.estimate("pending", 10**9) == 10**9 / PENDING_BYTES_PER_S  # no rtt
    assert rates.estimate("pending", 0) == 0.0
    assert rates.snapshot() == {"pending": PENDING_BYTES_PER_S}
    with pytest.raises(ValueError, match="nbytes"):
        rates.estimate("dram", -1)


def test_own_loads_are_an_ewma_of_seconds_per_byte_plus_the_rtt() -> None:
    rates = TierRates(clock=FakeClock())
    rates.observe_load("dram", 1_000_000, 0.001)  # 1 ns/byte
    assert rates.estimate("dram", 2_000_000) == pytest.approx(0.002)
    rates.observe_load("dram", 1_000_000, 0.003)  # 3 ns/byte; weight 0.3
    assert rates.estimate("dram", 1_000_000) == pytest.approx(0.3 * 0.003 + 0.7 * 0.001)
    rates.observe_rtt(0.002)
    rates.observe_rtt(0.001)
    assert rates.rtt_s == pytest.approx(0.3 * 0.001 + 0.7 * 0.002)
    rtt = 0.3 * 0.001 + 0.7 * 0.002
    assert rates.estimate("dram", 0) == pytest.approx(rtt)
    # a load's own round trip is taken out of it, as estimate adds it back once
    rates.observe_load("nvme", 1_000_000, rtt + 0.01)
    assert rates.estimate("nvme", 1_000_000) == pytest.approx(rtt + 0.01)
    rates.observe_load("hbm", 0, 1.0)
    rates.observe_load("hbm", 10, 0.0)
    assert rates.estimate("hbm", 10) is None


def test_stats_rate_is_delta_bytes_over_delta_seconds() -> None:
    rates = TierRates(clock=FakeClock())
    rates.observe_stats({"nvme": (10_000_000, 5.0)})
    assert rates.estimate("nvme", 1) is None  # a baseline only
    rates.observe_stats({"nvme": (12_000_000, 5.001)})  # 2 MB in 1 ms: 2 GB/s
    assert rates.estimate("nvme", 2_000_000) == pytest.approx(0.001)
    assert rates.snapshot()["nvme"] == pytest.approx(2e9)


def test_small_or_timeless_deltas_wait_and_add_up() -> None:
    rates = TierRates(clock=FakeClock())
    rates.observe_stats({"dram": (0, 0.0)})
    rates.observe_stats({"dram": (MIN_STATS_DELTA_BYTES - 1, 1e-5)})
    assert rates.estimate("dram", 1) is None
    rates.observe_stats({"dram": (2 * MIN_STATS_DELTA_BYTES, 0.0)})  # bytes, but no time yet
    assert rates.estimate("dram", 1) is None
    rates.observe_stats({"dram": (2 * MIN_STATS_DELTA_BYTES, 2 * MIN_STATS_DELTA_BYTES * 1e-9)})
    assert rates.estimate("dram", 10**9) == pytest.approx(1.0)  # measured from the first poll


def test_a_counter_that_went_down_restarts_the_baseline() -> None:
    rates = TierRates(clock=FakeClock())
    rates.observe_stats({"remote": (0, 0.0)})
    rates.observe_stats({"remote": (100_000_000, 1.0)})  # 100 MB/s
    rates.observe_stats({"remote": (1_000_000, 0.5)})  # the daemon restarted
    assert rates.estimate("remote", 100_000_000) == pytest.approx(1.0)  # the old rate stays
    rates.observe_stats({"remote": (51_000_000, 0.6)})  # 50 MB in 0.1 s from the new baseline
    assert rates.estimate("remote", 100_000_000) == pytest.approx(0.2)


def test_own_loads_win_while_fresh_then_stale_falls_back_to_the_stats() -> None:
    clock = FakeClock()
    rates = TierRates(clock=clock)
    rates.observe_stats({"nvme": (0, 0.0)})
    rates.observe_stats({"nvme": (1_000_000_000, 1.0)})  # the daemon: 1 GB/s
    rates.observe_load("nvme", 100_000_000, 10.0)  # ours: 10 MB/s (one bad load)
    assert rates.estimate("nvme", 100_000_000) == pytest.approx(10.0)
    clock.now += 29.9
    assert rates.estimate("nvme", 100_000_000) == pytest.approx(10.0)
    clock.now += 0.1
    assert rates.estimate("nvme", 100_000_000) == pytest.approx(0.1)
    assert rates.snapshot()["nvme"] == pytest.approx(1e9)
    # stale with no daemon figure: nothing current is known
    rates.observe_load("remote", 1_000_000, 1.0)
    clock.now += 30.0
    assert rates.estimate("remote", 1_000_000) is None
    assert "remote" not in rates.snapshot()


def test_a_fresh_load_after_a_stale_spell_starts_the_mean_afresh() -> None:
    clock = FakeClock()
    rates = TierRates(clock=clock)
    rates.observe_load("remote", 1_000_000, 40.0)
    clock.now += 31.0
    rates.observe_load("remote", 1_000_000, 0.01)
    assert rates.estimate("remote", 1_000_000) == pytest.approx(0.01)


def test_bad_settings_name_themselves() -> None:
    with pytest.raises(ValueError, match="stale_s"):
        TierRates(stale_s=0)
    with pytest.raises(ValueError, match="alpha"):
        TierRates(alpha=1.5)


# decide


def rates_of(clock: FakeClock | None = None, **bytes_per_s: float) -> TierRates:
    rates = TierRates(clock=clock or FakeClock())
    for tier, rate in bytes_per_s.items():
        rates.observe_load(tier, 1_000_000, 1_000_000 / rate)
    return rates


def decide_for(tiers: list[str], rates: TierRates, prefill: PrefillModel | None = None,
               policy: str = "auto", first_block: int = 0, extra_tokens: int = 100,
               block_bytes: int = BLOCK_BYTES) -> Decision:
    return decide(tiers=tiers, block_bytes=block_bytes, block_size=BLOCK, first_block=first_block,
                  num_tokens=(first_block + len(tiers)) * BLOCK + extra_tokens, policy=policy,
                  prefill=prefill or fitted(), rates=rates, step_tokens=STEP)


def test_a_fast_tier_loads_everything() -> None:
    d = decide_for(["dram"] * 128, rates_of(dram=10e9))
    assert (d.load_blocks, d.recompute_blocks) == (128, 0)
    assert d.load_s == pytest.approx(128 * BLOCK_BYTES / 10e9)
    assert d.compute_s is not None and d.compute_s > 0.1
    assert d.reason.startswith("load 128 blocks (dram) ~27 ms vs compute ~")


def test_a_slow_tier_recomputes_everything() -> None:
    d = decide_for(["remote"] * 128, rates_of(remote=50e6))
    assert (d.load_blocks, d.recompute_blocks) == (0, 128)
    assert d.load_s == 0.0
    assert d.reason.startswith("recompute 128 blocks: loading (remote) ~5.4 s vs compute ~")


def test_a_mixed_chain_is_cut_where_the_slow_tier_starts() -> None:
    d = decide_for(["hbm"] * 10 + ["dram"] * 30 + ["remote"] * 88,
                   rates_of(hbm=100e9, dram=10e9, remote=50e6))
    assert (d.load_blocks, d.recompute_blocks) == (40, 88)
    assert d.load_s == pytest.approx(40 * BLOCK_BYTES / 10e9)
    assert d.reason.startswith("load 40 (dram), recompute 88 (remote): ~")
    assert "vs load all ~" in d.reason and "compute all ~" in d.reason


def test_policies_always_and_never_override_the_estimates() -> None:
    slow = rates_of(remote=1e6)
    d = decide_for(["remote"] * 8, slow, policy="always")
    assert (d.load_blocks, d.recompute_blocks) == (8, 0)
    assert d.reason == "policy always: load 8 blocks (remote)"
    assert d.load_s == pytest.approx(8 * BLOCK_BYTES / 1e6)
    d = decide_for(["pending"] * 8, rates_of(), policy="never")
    assert (d.load_blocks, d.recompute_blocks) == (0, 8)
    assert d.reason == "policy never: recompute 8 blocks"
    # with nothing learnt, the policies still answer
    d = decide_for(["nvme"] * 8, rates_of(), prefill=PrefillModel(), policy="always")
    assert (d.load_blocks, d.load_s, d.compute_s) == (8, None, None)


def test_a_missing_estimate_loads_everything_and_says_which() -> None:
    d = decide_for(["dram"] * 4 + ["remote"] * 4, rates_of(dram=10e9))
    assert (d.load_blocks, d.recompute_blocks) == (8, 0)
    assert d.reason == "no estimate yet (remote rate): loading"
    assert d.load_s is None and d.compute_s is not None
    d = decide_for(["dram"] * 8, rates_of(dram=10e9), prefill=PrefillModel())
    assert (d.load_blocks, d.reason) == (8, "no estimate yet (prefill): loading")
    assert d.load_s == pytest.approx(8 * BLOCK_BYTES / 10e9)
    d = decide_for(["tape"] * 8, rates_of(), prefill=PrefillModel())
    assert d.reason == "no estimate yet (prefill, tape rate): loading"


def test_ties_go_to_loading_more() -> None:
    # a step-bound engine (every step 10 ms whatever it computes) and free loads: every cut
    # costs one step
    prefill = PrefillModel()
    for n in (100, 700, 2_000, 1_500):
        prefill.observe([(n, 3 * n)], 0.01)
    coef = prefill.coefficients
    assert coef is not None and coef[:2] == (0.0, 0.0) and coef[2] == pytest.approx(0.01)
    d = decide_for(["pending"] * 6, rates_of(), prefill=prefill, block_bytes=0)
    assert (d.load_blocks, d.recompute_blocks) == (6, 0)


def test_no_hit_and_misuse() -> None:
    assert decide_for([], rates_of()) == Decision(0, 0, "no hit")
    with pytest.raises(ValueError, match="policy"):
        decide_for(["dram"], rates_of(), policy="sometimes")
    with pytest.raises(ValueError, match="policy"):
        decide_for([], rates_of(), policy="")
    with pytest.raises(ValueError, match="first_block"):
        decide_for(["dram"], rates_of(), first_block=-1)
    with pytest.raises(ValueError, match="block_bytes"):
        decide_for(["dram"], rates_of(), block_bytes=-1)
    with pytest.raises(ValueError, match="num_tokens"):
        decide_for(["dram"] * 4, rates_of(), extra_tokens=-1)
    for name in ("block_size", "step_tokens", "num_tokens"):
        args = {"block_size": BLOCK, "step_tokens": STEP, "num_tokens": 64, name: -1}
        with pytest.raises(ValueError, match=name):
            decide(tiers=["dram"], block_bytes=1, first_block=0, policy="auto",
                   prefill=fitted(), rates=rates_of(), **args)


def test_slowest() -> None:
    assert slowest([]) == "pending"
    assert slowest(["hbm", "pending", "dram"]) == "dram"
    assert slowest(["remote", "nvme"]) == "remote"
    assert slowest(["remote", "tape", "disk"]) == "tape"  # unknown is slowest; first of equals


def brute_cost(k: int, tiers: list[str], block_bytes: int, first_block: int, num_tokens: int,
               prefill: PrefillModel, rates: TierRates, step: int) -> float:
    load = 0.0 if k == 0 else rates.estimate(slowest(tiers[:k]), k * block_bytes)
    ctx = (first_block + k) * BLOCK
    compute = prefill.estimate(num_tokens - ctx, ctx, step)
    assert load is not None and compute is not None
    return load + compute


def test_decide_finds_the_brute_force_minimum_over_random_cases() -> None:
    rng = random.Random(7)
    prefill = fitted(noise=0.02)
    names = ["pending", "hbm", "dram", "nvme", "remote"]
    cuts = 0
    for _ in range(300):
        clock = FakeClock()
        rates = rates_of(clock, **{t: 10 ** rng.uniform(6, 11) for t in names[1:]})
        rates.observe_rtt(rng.uniform(0, 0.005))
        # chains mostly get slower along the prefix, with some disorder
        tiers = sorted(rng.choices(names, k=rng.randrange(1, 120)),
                       key=lambda t: names.index(t) + rng.uniform(-1.5, 1.5))
        block_bytes = rng.choice([64 * 1024, 512 * 1024, 2 * 1024 * 1024])
        first_block = rng.randrange(0, 50)
        num_tokens = (first_block + len(tiers)) * BLOCK + rng.randrange(0, 3 * BLOCK)
        step = rng.choice([256, 2048, 8192])
        d = decide(tiers=tiers, block_bytes=block_bytes, block_size=BLOCK,
                   first_block=first_block, num_tokens=num_tokens, policy="auto",
                   prefill=prefill, rates=rates, step_tokens=step)
        costs = [brute_cost(k, tiers, block_bytes, first_block, num_tokens, prefill, rates, step)
                 for k in range(len(tiers) + 1)]
        assert d.load_blocks + d.recompute_blocks == len(tiers)
        assert costs[d.load_blocks] <= min(costs) + 1e-9
        assert all(c > costs[d.load_blocks] + 1e-9 for c in costs[d.load_blocks + 1:])
        cuts += 0 < d.load_blocks < len(tiers)
    assert cuts > 20  # the cases are not all load-all or recompute-all


class CountingPrefill(PrefillModel):
    calls = 0

    def estimates(self, tokens: np.ndarray, contexts: np.ndarray,
                  step_tokens: int) -> np.ndarray | None:
        self.calls += 1
        return super().estimates(tokens, contexts, step_tokens)


class CountingRates(TierRates):
    calls = 0

    def line(self, tier: str) -> tuple[float, float] | None:
        self.calls += 1
        return super().line(tier)


def test_a_long_chain_costs_one_compute_estimate_and_one_rate_per_tier() -> None:
    # decide runs on the engine's step loop: every cut is weighed, in array operations, not
    # in a call (and a lock) per block (it was ~2 us a block: 10 ms for this chain).
    prefill = CountingPrefill()
    fitted(model=prefill)
    prefill.calls = 0
    rates = CountingRates(clock=FakeClock())
    for tier, rate in (("dram", 10e9), ("nvme", 2e9), ("remote", 1e8)):
        rates.observe_load(tier, 1_000_000, 1_000_000 / rate)
    n = 5_000
    tiers = ["dram"] * 2_000 + ["nvme"] * 2_000 + ["remote"] * 1_000
    d = decide(tiers=tiers, block_bytes=BLOCK_BYTES, block_size=BLOCK, first_block=0,
               num_tokens=n * BLOCK + 7, policy="auto", prefill=prefill, rates=rates,
               step_tokens=STEP)
    assert d.load_blocks + d.recompute_blocks == n
    assert prefill.calls == 1
    assert rates.calls == 3


# the defaults on synthetic workloads


def test_a_tier_that_got_faster_is_tried_again_after_stale_s() -> None:
    """One slow load must not ban a tier: the defaults recompute for 30 s, then load again."""
    clock = FakeClock()
    rates = TierRates(clock=clock)
    prefill = fitted()
    tiers = ["nvme"] * 128
    rates.observe_load("nvme", 128 * BLOCK_BYTES, 40.0)  # a disk under someone's compaction
    assert decide_for(tiers, rates, prefill).load_blocks == 0
    clock.now += 30.0
    d = decide_for(tiers, rates, prefill)
    assert (d.load_blocks, d.reason) == (128, "no estimate yet (nvme rate): loading")
    rates.observe_load("nvme", 128 * BLOCK_BYTES, 0.1)  # the disk is back: 2.7 GB/s
    assert decide_for(tiers, rates, prefill).load_blocks == 128


def test_the_ewma_tracks_a_speed_change_within_a_few_loads() -> None:
    """alpha 0.3: a 10x change is within 10 % after 7 loads slower, 13 loads faster; 2x slower
    after 5."""

    def loads_to_track(old_rate: float, new_rate: float) -> int:
        rates = TierRates(clock=FakeClock())
        for _ in range(20):
            rates.observe_load("dram", 10**8, 10**8 / old_rate)
        for i in range(1, 100):
            rates.observe_load("dram", 10**8, 10**8 / new_rate)
            got = rates.estimate("dram", 10**8)
            assert got is not None
            if abs(got - 10**8 / new_rate) <= 0.1 * 10**8 / new_rate:
                return i
        raise AssertionError("never tracked")

    assert loads_to_track(1e9, 1e8) == 7
    assert loads_to_track(1e8, 1e9) == 13
    assert loads_to_track(1e9, 5e8) == 5


@pytest.mark.parametrize("noise", [0.0, 0.05, 0.15])
@pytest.mark.parametrize("prefill_share", [0.05, 0.4, 1.0])
def test_the_window_fits_mixed_workloads(noise: float, prefill_share: float) -> None:
    """256 steps of decodes and prefill chunks, timed with noise, predict a 32k prefill."""
    rng = random.Random(int(noise * 100 + prefill_share * 10))
    model = PrefillModel()
    while model.steps < 256:
        chunks = [(1, rng.randrange(10, 32_000)) for _ in range(rng.randrange(1, 48))]
        if rng.random() < prefill_share:
            chunks.append((rng.randrange(64, STEP + 1), rng.randrange(0, 30_000)))
        model.observe(chunks, true_seconds(chunks) * (1 + rng.gauss(0, noise)))
    got = model.estimate(32_768, 0, STEP)
    assert got == pytest.approx(chunked_truth(32_768, 0, STEP), rel=0.02 + noise / 2)
