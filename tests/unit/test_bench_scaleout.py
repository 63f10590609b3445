"""bench.scaleout without servers: each point's images and the results table."""

from __future__ import annotations

from bench.scaleout import CONCURRENCY, LAYOUTS, REPEATED_IMAGES, WORKLOADS, images_for, render


def test_each_point_gets_its_own_images_unique_or_repeated() -> None:
    seen: set[bytes] = set()
    for layout in LAYOUTS:
        for workload in WORKLOADS:
            for concurrency in CONCURRENCY:
                batch = images_for(layout, workload, concurrency, 12)
                distinct = set(batch)
                assert len(batch) == 12
                assert len(distinct) == (12 if workload == "unique" else REPEATED_IMAGES)
                assert not distinct & seen  # no point sees another's images (no stray store hits)
                seen |= distinct


def test_render_has_one_row_per_point() -> None:
    point = {
        "layout": "2E+1PD", "workload": "repeated", "concurrency": 4, "requests": 16, "distinct_images": 4,
        "throughput_rps": 1.5, "ttft_ms": {"p50": 100.0, "p90": 200.0}, "e2e_ms": {"p50": 300.0, "p90": None},
        "stage_ms_mean": {"encode": 50.0, "prefill": 20.0}, "encodes": 4.0, "cache_hits": 12,
        "cross_node_bytes": 4096.0, "remote_encode_ms_mean": None, "equal_to_llm": 16,
    }  # fmt: skip
    from builders.machine import describe_machine

    results = {"machine": describe_machine(), "command": "python -m bench.scaleout", "requests": 16,
               "ready_s": {"all": 60.0}, "points": [point, {**point, "layout": "all"}]}  # fmt: skip
    table = render(results)
    rows = [line for line in table.splitlines() if line.startswith("| 2E+1PD") or line.startswith("| all")]
    assert len(rows) == 2
    want = "| 2E+1PD | repeated (4) | 4 | 1.50 | 100 / 200 | 300 / - | - / - / 50 / 20 / - | 4 | 12 | 4096 | - "
    want += "| 16/16 |"
    assert want in rows
