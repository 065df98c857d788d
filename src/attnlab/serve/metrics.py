"""Prometheus metrics of the server: requests, errors, queue length, batch sizes, latency.

prometheus_client writes the exposition format (HELP/TYPE lines, label escaping, histogram
buckets with their _sum and _count); each app has its own registry, so two apps in one
process (the tests) never share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 65536)


class ServerMetrics:
    """The counters, gauge and histograms one server exports on /metrics."""

    def __init__(self, endpoints: set[str]) -> None:
        self.endpoints = endpoints  # other paths are counted as "other": no label per URL
        self.registry = CollectorRegistry()
        labels = ["endpoint", "status"]
        self.requests = Counter("attnlab_requests", "HTTP requests answered, by endpoint and "
                                "status code", labels, registry=self.registry)  # fmt: skip
        self.errors = Counter("attnlab_request_errors", "requests answered with a status of "
                              "400 or more", labels, registry=self.registry)  # fmt: skip
        self.latency = Histogram("attnlab_request_latency_seconds", "time from a request's "
                                 "arrival to its answer", ["endpoint"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)  # fmt: skip
        self.queue = Gauge("attnlab_queue_length", "requests waiting for a batch",
                           registry=self.registry)  # fmt: skip
        self.batch_items = Histogram("attnlab_batch_size", "inputs per model batch",
                                     buckets=SIZE_BUCKETS, registry=self.registry)  # fmt: skip
        self.batch_tokens = Histogram("attnlab_batch_tokens", "tokens per model batch",
                                      buckets=TOKEN_BUCKETS, registry=self.registry)  # fmt: skip
        self.disconnects = Counter("attnlab_client_disconnects", "requests whose client went "
                                   "away before the answer", registry=self.registry)  # fmt: skip

    def endpoint(self, path: str) -> str:
        """The endpoint label of a request path."""
        return path if path in self.endpoints else "other"

    def answered(self, path: str, status: int, seconds: float) -> None:
        """Count one answered request."""
        endpoint = self.endpoint(path)
        self.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.errors.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def queued(self, requests: int) -> None:
        """The number of requests waiting for a batch (Batcher's observer)."""
        self.queue.set(requests)

    def batch(self, items: int, tokens: int) -> None:
        """A batch started (Batcher's observer)."""
        self.batch_items.observe(items)
        self.batch_tokens.observe(tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
