"""bench.token_agreement without a server: the workloads it sends and how it reads answers."""

from __future__ import annotations

from bench.token_agreement import first_difference, table, workload_requests


def test_first_difference_names_the_first_token_that_moved() -> None:
    assert first_difference([5, 6, 7], [5, 6, 7]) is None
    assert first_difference([5, 9, 7], [5, 6, 7]) == 1
    assert first_difference([5, 6], [5, 6, 7]) == 2  # a prefix differs where it ends


def test_workload_requests_are_the_benchmarks_and_new_to_every_store() -> None:
    article = workload_requests("article", 3, salt="a")
    assert [len(r.images) for r in article] == [4, 4, 4]
    assert all(r.sampling["temperature"] == 0.0 and 2 <= r.sampling["max_tokens"] <= 16 for r in article)
    assert workload_requests("article", 3, salt="a") == article  # seeded
    assert workload_requests("article", 3, salt="b")[0].images != article[0].images  # a salt: new images
    (long_answer,) = workload_requests("long-answer", 1)
    assert len(long_answer.images) == 1 and long_answer.sampling["max_tokens"] == 256
    reuse = workload_requests("reuse", 8, salt="a")
    assert sum(r.reused_images for r in reuse) > 0  # images from the pool


def test_table_lists_only_the_requests_that_differ() -> None:
    report = {"article": {"colocated": {"requests": 3, "equal": 2, "first_difference": [None, 4, None]}}}
    assert "| article | colocated | 2 / 3 | 4 |" in table(report)
