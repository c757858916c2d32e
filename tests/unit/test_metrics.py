"""The server's own histograms: plain counts on the request path, Prometheus text when read
(as TorchServe's Java client writes it: frontend/observe/exposition.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frontend.observe.exposition import render
from frontend.observe.metrics import _Histogram

BOUNDS = (0.001, 0.01, 0.1, 1.0)
VALUES = (0.0005, 0.001, 0.002, 0.05, 0.1, 0.7, 3.0, 12.5)


def _samples(text: bytes, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name == name:
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_a_histogram_reads_as_prometheus_client_would_write_it() -> None:
    ours = _Histogram("t_seconds", "a test histogram", BOUNDS)
    reference = CollectorRegistry()
    theirs = Histogram("t_seconds", "a test histogram", ["model_name", "model_version"],
                       buckets=BOUNDS, registry=reference)
    for value in VALUES:  # boundary values go in their own bucket (le: less or equal)
        ours.observe(("m", "1.0"), value)
        theirs.labels("m", "1.0").observe(value)
    ours.observe(("n", "2.0"), 0.2)
    theirs.labels("n", "2.0").observe(0.2)
    assert _samples(render([ours.family()]), "t_seconds") == \
        _samples(generate_latest(reference), "t_seconds")


def test_bucket_counts_are_cumulative_with_count_and_sum() -> None:
    histogram = _Histogram("t", "t", BOUNDS)
    for value in VALUES:
        histogram.observe(("m", "1.0"), value)
    samples = _samples(render([histogram.family()]), "t")
    labels = (("model_name", "m"), ("model_version", "1.0"))
    buckets = {dict(key)["le"]: value for (name, key), value in samples.items()
               if name == "t_bucket"}
    assert buckets == {"0.001": 2, "0.01": 3, "0.1": 5, "1.0": 6, "+Inf": 8}
    assert samples[("t_count", labels)] == 8
    assert abs(samples[("t_sum", labels)] - sum(VALUES)) < 1e-9


def test_an_unobserved_histogram_has_no_series() -> None:
    assert _samples(render([_Histogram("t", "t", BOUNDS).family()]), "t") == {}
