"""The adaptive path rule (python_backends/epd/path_cost.py) with fake timings and a fake clock."""

from __future__ import annotations

import pytest

from python_backends.contract import COLOCATED_PATH, DISAGGREGATED_PATH, SERVING_PATHS
from python_backends.epd.path_cost import (
    BUSY_PROBE_FACTOR,
    MAX_PROBE_BACKOFF,
    Decision,
    PathCostModel,
    RequestShape,
    load_band,
    size_bucket,
)

UNIQUE = RequestShape(images=1, misses=1, largest_pixels=640 * 480, output_tokens=33)
HIT = RequestShape(images=1, misses=0, largest_pixels=640 * 480, output_tokens=33)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def trained(colocated_first: float, colocated_token: float, encode: float, prefill: float, token: float,
            clock: Clock | None = None, shared: bool = True, loads: tuple[int, ...] = (1,)) -> PathCostModel:
    """Every term known at each of ``loads``, with these times per unit of load."""
    model = PathCostModel(clock=clock or Clock(), shared_compute=shared)
    for load in loads:
        for _ in range(model.min_samples):  # enough samples of every term to be trusted
            for shape in (UNIQUE, HIT):
                model.observe_colocated(shape, colocated_first * load, colocated_token * 32 * load, 33, load=load)
                timings = {"encode": encode * load, "prefill": prefill * load, "decode": token * 32 * load}
                model.observe_disaggregated(shape, timings, 33, load, 1)
    return model


def test_buckets() -> None:
    assert [size_bucket(p) for p in (0, 300 * 300, 640 * 480, 1024 * 1024, 4000 * 3000)] == [
        "none", "small", "medium", "large", "xlarge"]


def test_predictions_add_the_stage_estimates() -> None:
    model = trained(colocated_first=40, colocated_token=3, encode=55, prefill=25, token=5)
    assert model.predict(COLOCATED_PATH, UNIQUE) == pytest.approx(40 + 32 * 3)
    assert model.predict(DISAGGREGATED_PATH, UNIQUE) == pytest.approx(55 + 25 + 32 * 5)
    assert model.predict(DISAGGREGATED_PATH, HIT) == pytest.approx(25 + 32 * 5)  # no encode for a hit


def test_picks_the_lower_prediction_either_way() -> None:
    slow_colocated = trained(colocated_first=400, colocated_token=30, encode=55, prefill=25, token=5)
    fast_colocated = trained(colocated_first=40, colocated_token=3, encode=55, prefill=25, token=5)
    assert slow_colocated.choose(UNIQUE, SERVING_PATHS).path == DISAGGREGATED_PATH
    assert fast_colocated.choose(UNIQUE, SERVING_PATHS).path == COLOCATED_PATH
    assert fast_colocated.choose(UNIQUE, SERVING_PATHS).reason == "predicted"


def test_store_hits_change_the_decision() -> None:
    # Encoding is what makes disaggregated lose here; with the image stored it wins.
    model = trained(colocated_first=120, colocated_token=4, encode=200, prefill=20, token=4)
    assert model.choose(UNIQUE, SERVING_PATHS).path == COLOCATED_PATH
    assert model.choose(HIT, SERVING_PATHS).path == DISAGGREGATED_PATH


def test_load_scales_predictions_and_samples_are_per_unit_of_load() -> None:
    model = trained(colocated_first=40, colocated_token=3, encode=55, prefill=25, token=5, shared=False, loads=(1, 4))
    idle = model.predict(COLOCATED_PATH, UNIQUE)
    for _ in range(3):
        model.started(COLOCATED_PATH)
    assert model.predict(COLOCATED_PATH, UNIQUE) == pytest.approx(4 * idle)  # type: ignore[operator]
    # Not sharing compute: the other path's load is its own, so it now wins.
    assert model.choose(UNIQUE, SERVING_PATHS).path == DISAGGREGATED_PATH
    # A sample taken under load 4 counts a quarter per unit.
    fresh = PathCostModel()
    fresh.observe_colocated(UNIQUE, 400, 0, 1, load=4)
    assert fresh.estimates[(COLOCATED_PATH, "first_token/media", "medium")].value == pytest.approx(100)


def test_a_sample_counts_the_load_it_ran_under_not_the_one_it_started_under() -> None:
    """The first request of a burst starts alone and runs with the rest of the burst."""
    clock = Clock()
    model = PathCostModel(clock=clock)
    first = model.started(COLOCATED_PATH)
    clock.now = 1.0
    burst = [model.started(COLOCATED_PATH) for _ in range(7)]
    assert first.load == 1 and [mark.load for mark in burst] == list(range(2, 9))
    clock.now = 2.0
    assert model.mean_load(first) == pytest.approx((1 * 1.0 + 8 * 1.0) / 2.0)
    assert model.mean_load(burst[0]) == pytest.approx(8.0)
    model.observe_colocated(UNIQUE, 900, 0, 1, load=model.mean_load(first))
    assert model.estimates[(COLOCATED_PATH, "first_token/media", "medium")].value == pytest.approx(200)
    for _ in range(7):
        model.finished(COLOCATED_PATH)
    clock.now = 4.0  # alone again for 2 s: (1 + 8 + 2) / 4
    assert model.mean_load(first) == pytest.approx(11.0 / 4.0)
    # Under shared compute the other path's requests count too.
    other = model.started(DISAGGREGATED_PATH)
    clock.now = 5.0
    assert model.mean_load(other) == pytest.approx(2.0)
    assert model.mean_load(model.started(COLOCATED_PATH)) == 3.0  # no time passed: the load it starts under


@pytest.mark.parametrize("shared", [True, False])
def test_a_sample_taken_beside_the_other_path_is_dropped_on_shared_compute(shared: bool) -> None:
    clock = Clock()
    model = PathCostModel(clock=clock, shared_compute=shared)
    alone = model.started(COLOCATED_PATH)
    clock.now = 1.0
    assert model.sample_load(alone) == 1.0
    probe = model.started(DISAGGREGATED_PATH, probe=True)
    beside = model.started(COLOCATED_PATH)
    clock.now = 2.0
    model.finished(DISAGGREGATED_PATH)
    clock.now = 3.0
    if shared:  # they ran beside the other path for a while: slow on both, telling of neither
        assert model.sample_load(beside) is None and model.sample_load(alone) is None
        assert model.sample_load(probe) == pytest.approx((3 + 2) / 2)  # a probe is measured all the same
    else:  # the paths have hardware of their own: only a path's own load counts
        assert model.sample_load(beside) == pytest.approx(2.0)  # it ran beside `alone`
        assert model.sample_load(probe) == pytest.approx(1.0)
    assert model.sample_load(model.started(COLOCATED_PATH)) == 3.0  # no time yet: the load it starts under


def test_shared_compute_loads_both_paths_alike() -> None:
    model = trained(colocated_first=40, colocated_token=3, encode=55, prefill=25, token=5, shared=True, loads=(1, 8))
    for _ in range(7):
        model.started(COLOCATED_PATH)
    assert model.load(DISAGGREGATED_PATH) == model.load(COLOCATED_PATH) == 7
    assert model.choose(UNIQUE, SERVING_PATHS).path == COLOCATED_PATH  # same cores: service time decides


def test_unknown_paths_are_probed_one_at_a_time_then_refreshed_when_stale() -> None:
    clock = Clock()
    model = PathCostModel(clock=clock, probe_interval_s=30)
    first = model.choose(UNIQUE, SERVING_PATHS)
    assert first.reason == "probe" and first.predicted_ms == {DISAGGREGATED_PATH: None, COLOCATED_PATH: None}
    model.started(first.path, probe=True)
    assert model.choose(UNIQUE, SERVING_PATHS).reason == "predicted"  # one probe at a time
    model.finished(first.path)

    model = trained(colocated_first=40, colocated_token=3, encode=55, prefill=25, token=5, clock=clock)
    assert model.choose(UNIQUE, SERVING_PATHS).path == COLOCATED_PATH
    clock.now = 31.0
    model.observe_colocated(UNIQUE, 40, 3 * 32, 33, load=1)  # colocated stays fresh, disaggregated ages
    decision = model.choose(UNIQUE, SERVING_PATHS)
    assert (decision.path, decision.reason) == (DISAGGREGATED_PATH, "probe")


def test_estimates_follow_recent_samples() -> None:
    model = PathCostModel(window=4)
    for ms in (100, 100, 20, 20, 20):
        model.observe_colocated(HIT, ms, 0, 1, load=1)
    assert model.estimates[(COLOCATED_PATH, "first_token/embeds", "medium")].value == pytest.approx(20)


def test_a_cold_first_sample_does_not_decide_once_warm_samples_follow() -> None:
    """What the 2026-12-01 benchmark showed: the colocated engine's first request was ~7x slower
    than the next ones (a cold engine). It must not keep adaptive on the slower path."""
    model = PathCostModel()
    cold, warm = 1050.0, 150.0
    for first in (cold, warm, warm):
        model.observe_colocated(UNIQUE, first, 20.0 * 32, 33, load=1)
    for _ in range(3):
        model.observe_disaggregated(UNIQUE, {"encode": 150, "prefill": 150, "decode": 40.0 * 32}, 33, 1, 1)
    assert model.predict(COLOCATED_PATH, UNIQUE) == pytest.approx(warm + 32 * 20)
    assert model.choose(UNIQUE, SERVING_PATHS).path == COLOCATED_PATH


def test_a_path_with_too_few_samples_is_probed_before_it_is_trusted() -> None:
    model = PathCostModel(min_samples=3)
    for _ in range(3):
        model.observe_colocated(UNIQUE, 150, 20.0 * 32, 33, load=1)
    slow = {"encode": 500, "prefill": 500, "decode": 80.0 * 32}
    model.observe_disaggregated(UNIQUE, slow, 33, 1, 1)  # one (perhaps unlucky) sample
    decision = model.choose(UNIQUE, SERVING_PATHS)
    assert (decision.path, decision.reason) == (DISAGGREGATED_PATH, "probe")
    model.observe_disaggregated(UNIQUE, slow, 33, 1, 1)
    model.observe_disaggregated(UNIQUE, slow, 33, 1, 1)
    decision = model.choose(UNIQUE, SERVING_PATHS)
    assert (decision.path, decision.reason) == (COLOCATED_PATH, "predicted")


def test_window_and_min_samples_are_checked() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        PathCostModel(window=2, min_samples=3)


def test_estimates_are_kept_per_load_band() -> None:
    assert [load_band(n) for n in (0, 1, 2, 3, 4, 7, 8, 30)] == [1, 1, 2, 2, 4, 4, 8, 8]
    model = PathCostModel(shared_compute=False)
    for _ in range(3):
        model.observe_colocated(HIT, 100, 0, 1, load=1)  # 100 per unit alone
        model.observe_colocated(HIT, 4 * 40, 0, 1, load=4)  # batching: 40 per unit at 4
    estimate = model.estimates[(COLOCATED_PATH, "first_token/embeds", "medium")]
    assert (estimate.value_at(1), estimate.value_at(5)) == (100, 40)
    assert estimate.value_at(2) == pytest.approx(70)  # no samples at 2-3: every load's


def test_a_new_load_band_is_probed_where_the_paths_have_hardware_of_their_own() -> None:
    """Apart (not sharing compute), a path that might win is measured at a load it has not run
    at yet; on shared cores it is not (a probe at each new load mixes the paths, see below)."""
    for shared in (False, True):
        model = trained(colocated_first=30, colocated_token=8, encode=0, prefill=25, token=7, shared=shared,
                        loads=(1, 4))
        model.estimates = {key: est for key, est in model.estimates.items() if key[0] == DISAGGREGATED_PATH}
        for _ in range(3):
            model.observe_colocated(HIT, 10, 3 * 32, 33, load=1)  # colocated known at load 1 only
        for _ in range(3):
            model.started(COLOCATED_PATH)  # its load is 4 now
        decision = model.choose(HIT, SERVING_PATHS)
        if shared:
            assert decision.reason != "probe", decision
            continue
        probes = 0
        while (decision := model.choose(HIT, SERVING_PATHS)).reason == "probe":
            assert decision.path == COLOCATED_PATH
            probes += 1
            model.started(COLOCATED_PATH, probe=True)
            model.observe_colocated(HIT, 4 * 5, 4 * 2 * 32, 33, load=4)  # at load 4: 5 + 2/token per unit
            model.finished(COLOCATED_PATH)
        assert probes == model.min_samples
        assert decision.reason == "predicted"
        assert decision.predicted_ms[COLOCATED_PATH] == pytest.approx(4 * (5 + 2 * 32))  # its band-4 samples


def test_a_path_far_behind_is_not_probed_at_each_new_load_only_when_it_ages() -> None:
    clock = Clock()
    model = trained(colocated_first=40, colocated_token=3, encode=300, prefill=200, token=10, clock=clock)
    for _ in range(4):
        model.started(COLOCATED_PATH)  # load 5: no samples of either path in band 4
    decision = model.choose(UNIQUE, SERVING_PATHS)
    assert (decision.path, decision.reason) == (COLOCATED_PATH, "predicted")  # disaggregated is 6x slower
    clock.now = 11.0
    model.observe_colocated(UNIQUE, 40 * 5, 3 * 32 * 5, 33, load=5)
    for _ in range(4):
        model.finished(COLOCATED_PATH)
    assert model.choose(UNIQUE, SERVING_PATHS).reason == "probe"  # its estimate is older than 10 s


def test_on_shared_cores_a_stale_path_is_probed_when_idle_or_once_long_stale() -> None:
    """A probe under load slows every request in flight (shared cores): it waits for an idle
    moment, up to BUSY_PROBE_FACTOR probe intervals."""
    clock = Clock()
    model = trained(colocated_first=40, colocated_token=3, encode=300, prefill=200, token=10, clock=clock)
    model.started(COLOCATED_PATH)
    clock.now = 11.0
    model.observe_colocated(UNIQUE, 40 * 2, 3 * 32 * 2, 33, load=2)  # colocated fresh, disaggregated 11 s old
    assert model.choose(UNIQUE, SERVING_PATHS).reason == "predicted"  # busy: not yet
    model.finished(COLOCATED_PATH)
    assert model.choose(UNIQUE, SERVING_PATHS).reason == "probe"  # idle: now
    model.started(COLOCATED_PATH)
    clock.now = model.probe_interval_s * BUSY_PROBE_FACTOR + 1
    model.observe_colocated(UNIQUE, 40 * 2, 3 * 32 * 2, 33, load=2)
    assert model.choose(UNIQUE, SERVING_PATHS).reason == "probe"  # too old to wait any longer


def test_a_busy_path_is_kept_unless_the_other_is_clearly_faster() -> None:
    """Splitting one load between both paths' engines on shared cores is slower than either alone."""
    def with_one_busy_disaggregated_request(colocated_token: float, shared: bool = True) -> PathCostModel:
        model = trained(colocated_first=40, colocated_token=colocated_token, encode=0, prefill=40, token=5,
                        shared=shared, loads=(1, 2))
        model.started(DISAGGREGATED_PATH)
        return model

    a_little_faster = with_one_busy_disaggregated_request(colocated_token=4.5)  # 184 vs 200 per unit
    decision = a_little_faster.choose(HIT, SERVING_PATHS)
    assert (decision.path, decision.reason) == (DISAGGREGATED_PATH, "kept")
    mostly_busy = with_one_busy_disaggregated_request(colocated_token=4.5)
    mostly_busy.started(DISAGGREGATED_PATH)
    mostly_busy.started(COLOCATED_PATH)  # a probe on the other path: disaggregated still has more
    assert mostly_busy.choose(HIT, SERVING_PATHS).reason == "kept"
    clearly_faster = with_one_busy_disaggregated_request(colocated_token=3)  # 136 vs 200
    assert clearly_faster.choose(HIT, SERVING_PATHS).path == COLOCATED_PATH
    apart = with_one_busy_disaggregated_request(colocated_token=4.5, shared=False)  # own cores: no mixing cost
    assert apart.choose(HIT, SERVING_PATHS).path == COLOCATED_PATH
    idle = trained(colocated_first=40, colocated_token=4.5, encode=0, prefill=40, token=5)
    assert idle.choose(HIT, SERVING_PATHS).path == COLOCATED_PATH


def test_one_available_path_is_the_answer() -> None:
    model = trained(colocated_first=400, colocated_token=30, encode=55, prefill=25, token=5)
    decision = model.choose(UNIQUE, [COLOCATED_PATH])
    assert (decision.path, decision.reason) == (COLOCATED_PATH, "only")
    with pytest.raises(ValueError, match="no serving path"):
        model.choose(UNIQUE, [])


def test_a_probe_in_flight_does_not_make_its_path_the_one_kept() -> None:
    """The probe at the start of a burst goes to the other path; the requests that follow it must
    not be kept there because that path is now the busier one."""
    clock = Clock()
    model = trained(colocated_first=40, colocated_token=4.5, encode=0, prefill=40, token=5, clock=clock)
    clock.now = 11.0  # both estimates stale; idle: a probe
    probe = model.choose(HIT, SERVING_PATHS)
    assert probe.reason == "probe"
    model.started(probe.path, probe=True)
    follower = model.choose(HIT, SERVING_PATHS)
    assert follower.reason == "predicted" and follower.path == COLOCATED_PATH, follower


def test_a_path_each_probe_finds_slower_is_probed_ever_less_often() -> None:
    """Stale probes back off (2x per probe that finds the path still slower, up to
    MAX_PROBE_BACKOFF intervals); the interval is the base one again once the path is the best."""
    clock = Clock()
    model = trained(colocated_first=40, colocated_token=3, encode=300, prefill=200, token=10, clock=clock)
    base = model.probe_interval_s

    def serve(colocated_first: float = 40) -> Decision:
        decision = model.choose(UNIQUE, SERVING_PATHS)
        model.started(decision.path, probe=decision.reason == "probe")
        if decision.path == COLOCATED_PATH:
            model.observe_colocated(UNIQUE, colocated_first, 3 * 32, 33, load=1)
        else:
            model.observe_disaggregated(UNIQUE, {"encode": 300, "prefill": 200, "decode": 320}, 33, 1, 1)
        model.finished(decision.path)
        return decision

    probes = []
    for second in range(1, 1201):  # 20 minutes of one request a second, epd idle in between
        clock.now = float(second)
        if serve().reason == "probe":
            probes.append(second)
    gaps = [later - earlier for earlier, later in zip(probes, probes[1:], strict=False)]
    assert gaps[:4] == [2 * base + 1, 4 * base + 1, 8 * base + 1, 16 * base + 1]  # +1: stale once older
    assert set(gaps[4:]) == {MAX_PROBE_BACKOFF * base + 1}
    assert len(probes) == 10  # without the backoff: one every 11 s, 109
    assert model.probe_intervals[DISAGGREGATED_PATH] == MAX_PROBE_BACKOFF * base

    clock.now += 1
    while serve(colocated_first=5000).path == COLOCATED_PATH:  # colocated turns slow
        clock.now += 1
    assert model.probe_intervals[DISAGGREGATED_PATH] == base  # the best path: base interval again
