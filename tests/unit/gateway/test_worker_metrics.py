"""The merged /metrics page of gateway workers (gateway/worker_metrics.py)."""

from __future__ import annotations

import socket

from prometheus_client.parser import text_string_to_metric_families

from kiloserve.gateway.worker_metrics import WorkerMetrics, merge_pages

PAGE = """# HELP reqs_total requests
# TYPE reqs_total counter
reqs_total{backend="a",status="200"} %d
reqs_created{backend="a",status="200"} 1.7e9
# HELP depth queue depth
# TYPE depth gauge
depth{model="m"} %d
# HELP lat latency
# TYPE lat histogram
lat_bucket{le="0.1"} %d
lat_bucket{le="+Inf"} %d
lat_sum 1.5
lat_count %d
"""


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_and_histograms_sum_and_gauges_keep_a_series_per_worker() -> None:
    got = _samples(merge_pages([(0, PAGE % (3, 2, 1, 3, 3)), (1, PAGE % (4, 5, 2, 4, 4))]))
    assert got[("reqs_total", (("backend", "a"), ("status", "200")))] == 7
    assert got[("lat_bucket", (("le", "0.1"),))] == 3
    assert got[("lat_count", ())] == 7 and got[("lat_sum", ())] == 3.0
    assert got[("depth", (("model", "m"), ("worker", "0")))] == 2
    assert got[("depth", (("model", "m"), ("worker", "1")))] == 5
    assert not any(name.endswith("_created") for name, _ in got)


def test_label_values_are_escaped() -> None:
    page = '# TYPE g gauge\ng{path="a\\\\b\\"c\\nd"} 1\n'
    got = _samples(merge_pages([(0, page)]))
    assert got[("g", (("path", 'a\\b"c\nd'), ("worker", "0")))] == 1


def test_gauges_of_the_shared_view_appear_once() -> None:
    """Each worker holds the whole gateway's in-flight count per backend (the shared
    view): the merged page gives it once, as the answering worker (the first page)
    sees it, not once per worker (summed by an autoscaler, N times the truth)."""
    page = (
        "# HELP kiloserve_gateway_in_flight requests in flight\n"
        "# TYPE kiloserve_gateway_in_flight gauge\n"
        'kiloserve_gateway_in_flight{backend="a"} %d\n'
        "# HELP kiloserve_gateway_registry_up registry watch\n"
        "# TYPE kiloserve_gateway_registry_up gauge\n"
        "kiloserve_gateway_registry_up %d\n"
    )
    got = _samples(merge_pages([(1, page % (6, 1)), (0, page % (5, 0))]))
    assert got[("kiloserve_gateway_in_flight", (("backend", "a"),))] == 6
    assert [k for k in got if k[0] == "kiloserve_gateway_in_flight"] == [
        ("kiloserve_gateway_in_flight", (("backend", "a"),))
    ]
    assert got[("kiloserve_gateway_registry_up", (("worker", "1"),))] == 1
    assert got[("kiloserve_gateway_registry_up", (("worker", "0"),))] == 0


async def test_a_page_says_how_many_siblings_it_lacks() -> None:
    """A sibling that does not answer is left out of the page, and the page says so
    (``worker_pages_missing``): a reader comparing two pages' counters reads again."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    port = dead.getsockname()[1]
    try:
        metrics = WorkerMetrics(0, lambda: [(0, 1), (1, port)], timeout_s=0.5)
        got = _samples(await metrics.render(PAGE % (3, 2, 1, 3, 3)))
        assert got[("reqs_total", (("backend", "a"), ("status", "200")))] == 3
        assert got[("kiloserve_gateway_worker_pages_missing", ())] == 1
        assert got[("kiloserve_gateway_worker_scrape_errors_total", ())] == 1
        alone = WorkerMetrics(0, lambda: [(0, 1)])
        got = _samples(await alone.render(PAGE % (3, 2, 1, 3, 3)))
        assert got[("kiloserve_gateway_worker_pages_missing", ())] == 0
    finally:
        dead.close()
