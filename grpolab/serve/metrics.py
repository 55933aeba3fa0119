"""GET /metrics: the server's counters in Prometheus' text format (prometheus_client), named as vLLM
names its own with the `grpolab:` prefix where the meaning is the same:

- grpolab:http_requests_total{endpoint, status}   every HTTP request by route (unknown paths: "other")
                                                   and status code, 4xx and 5xx included
- grpolab:prompt_tokens_total                     prompt tokens of the generation requests answered
- grpolab:generation_tokens_total                 completion tokens sampled for them
- grpolab:num_requests_running                    rows decoding now (a request of n choices is n rows)
- grpolab:num_requests_waiting                    rows submitted and not yet admitted to the batch
- grpolab:e2e_request_latency_seconds             a generation request's time, arrival to last byte
- grpolab:time_to_first_token_seconds             a prompt's time from arrival to the end of its prefill
                                                   (its first token is sampled from that prefill's logits)
- grpolab:prefix_cache_queries_total              prompt tokens looked up in the prefix cache (when it is on)
- grpolab:prefix_cache_hits_total                 of those, tokens whose keys and values came from the cache

Each app has its own CollectorRegistry, so servers (or tests) in one process never share counts.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

# seconds; vLLM's buckets for the same histograms, cut to what a CPU server sees
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The counters of one server; `batcher` is read at each scrape for the running and waiting rows."""

    def __init__(self, batcher) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("grpolab:http_requests", "HTTP requests by route and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("grpolab:prompt_tokens", "Prompt tokens of answered generation requests",
                                     registry=r)
        self.generation_tokens = Counter("grpolab:generation_tokens", "Completion tokens sampled", registry=r)
        Gauge("grpolab:num_requests_running", "Rows decoding (a request of n choices is n rows)",
              registry=r).set_function(lambda: batcher.running)
        Gauge("grpolab:num_requests_waiting", "Rows waiting for a place in the batch",
              registry=r).set_function(lambda: batcher.waiting_rows)
        self.latency = Histogram("grpolab:e2e_request_latency_seconds", "Generation request time, arrival to end",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("grpolab:time_to_first_token_seconds", "Time from arrival to the end of the prefill",
                              buckets=TTFT_BUCKETS, registry=r)
        prefix_cache = getattr(batcher, "prefix_cache", None)   # (a server built without a batcher: None)
        if prefix_cache is not None:
            r.register(_PrefixCacheCounts(prefix_cache))

    def answered(self, start: float, jobs, usage: dict) -> None:
        """A generation request that began at time.monotonic() `start` has been answered in full."""
        self.latency.observe(time.monotonic() - start)
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        for job in jobs:
            if job.prefilled_at is not None:
                self.ttft.observe(job.prefilled_at - start)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCounts:
    """The prefix cache's own token counts, read at each scrape (vLLM's prefix_cache_queries and _hits)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        yield CounterMetricFamily("grpolab:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=self.cache.queries)
        yield CounterMetricFamily("grpolab:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=self.cache.hits)


class CountRequests:
    """ASGI middleware: counts every HTTP request by route (`paths`: the app's routes; others are "other",
    so a scan of random URLs cannot grow the label set) and by the status code it was answered with."""

    def __init__(self, app, metrics: Metrics, paths: set[str]) -> None:
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500   # no response started: the app failed

        async def sent(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            endpoint = scope["path"] if scope["path"] in self.paths else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
