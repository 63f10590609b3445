"""Which encoder an image goes to (docs/scale-out.md): the one rule (rendezvous homes, for
encoder models and servers alike), homes moved when an encoder joins or leaves, bounded load,
and the circuit breaker with a fake clock."""

from __future__ import annotations

import hashlib

import pytest

from python_backends.scaleout.routing import (
    BreakerState,
    CircuitBreaker,
    NoEncoderAvailable,
    Router,
    home,
    rendezvous_order,
)

KEYS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4000)]
TWO = ["10.0.0.1:8001", "10.0.0.2:8001"]
THIRD = "10.0.0.3:8001"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def homes(router: Router, keys: list[str]) -> dict[str, str | None]:
    return {key: router.home(key) for key in keys}


def test_homes_are_stable_and_spread() -> None:
    router = Router()
    router.set_endpoints(TWO)
    first = homes(router, KEYS)
    assert homes(router, KEYS) == first  # the same image always meets the same encoder
    assert Router(encoders={}).home(KEYS[0]) is None
    share = sum(1 for home in first.values() if home == TWO[0]) / len(KEYS)
    assert 0.45 < share < 0.55
    # Independent of the order the endpoints were listed in.
    reordered = Router()
    reordered.set_endpoints(list(reversed(TWO)))
    assert homes(reordered, KEYS) == first


def test_one_rule_for_encoder_models_and_servers() -> None:
    """``home`` is the rule; the router's home (all healthy) is it, whatever the listing order."""
    router = Router()
    router.set_endpoints([*TWO, THIRD])
    models = ["encoder_0", "encoder_1", "encoder_2"]
    for key in KEYS[:200]:
        assert router.home(key) == home([*TWO, THIRD], key) == home([THIRD, *reversed(TWO)], key)
        assert home(models, key) == rendezvous_order(models, key)[0]
    shares = [sum(1 for key in KEYS if home(models, key) == model) / len(KEYS) for model in models]
    assert all(0.29 < share < 0.38 for share in shares)  # encoder models spread like servers
    with pytest.raises(ValueError):
        home([], KEYS[0])


@pytest.mark.parametrize("start", [2, 3, 5])
def test_adding_an_encoder_moves_about_one_nth_of_the_homes(start: int) -> None:
    addresses = [f"10.0.0.{i}:8001" for i in range(1, start + 2)]
    router = Router()
    router.set_endpoints(addresses[:start])
    before = homes(router, KEYS)
    router.set_endpoints(addresses)
    after = homes(router, KEYS)
    moved = [key for key in KEYS if before[key] != after[key]]
    # Only keys the newcomer wins move, and they move to it: ~1/(N+1) of them.
    assert all(after[key] == addresses[-1] for key in moved)
    assert abs(len(moved) / len(KEYS) - 1 / (start + 1)) < 0.04
    if start == 2:
        assert 0.20 <= len(moved) / len(KEYS) <= 0.45  # the band tests/server/test_scaleout.py measures


def test_removing_an_encoder_moves_only_its_homes() -> None:
    router = Router()
    router.set_endpoints([*TWO, THIRD])
    before = homes(router, KEYS)
    router.set_endpoints(TWO)
    after = homes(router, KEYS)
    assert all(after[key] == before[key] for key in KEYS if before[key] != THIRD)


def test_bounded_load_spills_to_the_least_loaded_encoder() -> None:
    router = Router(load_factor=1.0, min_bound=2)
    router.set_endpoints([*TWO, THIRD])
    key = KEYS[0]
    home = router.home(key)
    assert router.choose(key).address == home and router.decisions == {"home": 1, "spilled": 0}
    with router.calling(home), router.calling(home):  # the home is at its bound (2 >= ceil(3/3), 2)
        route = router.choose(key)
        assert route.decision == "spilled" and route.address != home
        # The spill goes to the least-loaded one; ties follow the key's rendezvous order.
        others = [a for a in rendezvous_order([*TWO, THIRD], key) if a != home]
        assert route.address == others[0]
        with router.calling(others[0]):
            assert router.choose(key).address == others[1]
    assert router.encoders[home].in_flight == 0
    assert router.choose(key).address == home  # load gone: back home


def test_choose_avoids_encoders_already_tried() -> None:
    router = Router()
    router.set_endpoints(TWO)
    home = router.home(KEYS[1])
    assert router.choose(KEYS[1], exclude=[home]).address != home
    with pytest.raises(NoEncoderAvailable, match="breaker closed"):
        router.choose(KEYS[1], exclude=TWO)


def test_not_ready_encoders_get_nothing_and_membership_keeps_state() -> None:
    router = Router()
    router.set_endpoints(TWO)
    router.set_ready(TWO[0], False)
    assert {router.choose(key).address for key in KEYS[:50]} == {TWO[1]}
    router.set_endpoints([*TWO, THIRD])
    assert not router.encoders[TWO[0]].ready  # a kept encoder keeps what was known about it
    router.set_endpoints([])
    with pytest.raises(NoEncoderAvailable, match="no encoder endpoints"):
        router.choose(KEYS[0])


def test_breaker_opens_after_failures_in_a_row_then_probes_back_in() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(fail_threshold=3, backoff_s=2.0, max_backoff_s=5.0, clock=clock)
    breaker.failed()
    breaker.failed()
    breaker.succeeded()  # not in a row: still closed
    for _ in range(2):
        breaker.failed()
    assert breaker.state == BreakerState.CLOSED and breaker.allows()
    breaker.failed()
    assert breaker.state == BreakerState.OPEN and not breaker.allows() and breaker.opens == 1
    breaker.failed()  # a call started before it opened fails late: the back-off is unchanged
    assert breaker.opens == 1
    clock.now += 2.0
    assert breaker.state == BreakerState.HALF_OPEN and breaker.allows()
    breaker.started()  # the probe
    assert not breaker.allows()  # one probe at a time
    breaker.failed()
    assert breaker.state == BreakerState.OPEN
    clock.now += 3.9
    assert breaker.state == BreakerState.OPEN and breaker.opens == 2  # the back-off doubled to 4 s
    clock.now += 0.1
    breaker.started()
    breaker.failed()
    clock.now += 4.9
    assert breaker.state == BreakerState.OPEN
    clock.now += 0.1
    assert breaker.state == BreakerState.HALF_OPEN  # capped at max_backoff_s = 5 s
    breaker.started()
    breaker.succeeded()
    assert breaker.state == BreakerState.CLOSED and breaker.failures_in_a_row == 0


def test_router_takes_an_open_encoder_out_and_back() -> None:
    clock = FakeClock()
    router = Router(breaker=lambda: CircuitBreaker(fail_threshold=2, backoff_s=1.0, clock=clock))
    router.set_endpoints(TWO)
    dead = TWO[0]
    for _ in range(2):
        with router.calling(dead):
            router.failed(dead)
    assert router.healthy() == [TWO[1]]
    assert "breaker open" in router.describe()
    clock.now += 1.0
    assert router.healthy() == TWO  # half-open: one probe may go
    with router.calling(dead):
        assert router.healthy() == [TWO[1]]
        router.succeeded(dead)
    assert router.encoders[dead].breaker.state == BreakerState.CLOSED


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Router(load_factor=0.5)
    with pytest.raises(ValueError):
        CircuitBreaker(fail_threshold=0)
