"""What /metrics shows (Prometheus): latency histograms observed by the engine's worker, and gauges read from
the engine when scraped. The HTTP layer adds its request counters to the same registry. Each replica has its
own: `infinigen_replica_info{replica="host:pid"}` says which one answered a scrape."""

from __future__ import annotations

import os
import socket

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds: a first token takes a prefill (and a wait in the queue); later tokens take one decode step
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class Metrics:
    def __init__(self, engine):
        r = self.registry = CollectorRegistry()
        # Which process answered: every replica (--replicas N) has its own registry and a scrape through the proxy
        # reaches one of them; sum the series over this label's values for the server's totals.
        Info("infinigen_replica", "the replica (process) whose metrics these are", registry=r).info(
            {"replica": f"{socket.gethostname()}:{os.getpid()}", "method": engine.method})
        self.ttft = Histogram("infinigen_time_to_first_token_seconds", "from a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("infinigen_inter_token_latency_seconds", "between two tokens of one request",
                             buckets=ITL_BUCKETS, registry=r)
        # where the worker's time goes: prompt chunks or decode steps (and how full the steps are)
        self.prefill_seconds = Counter("infinigen_prefill_seconds", "worker time in prefill chunks", registry=r)
        self.prefill_tokens = Counter("infinigen_prefill_tokens", "prompt tokens prefilled", registry=r)
        self.prefill_cached_tokens = Counter("infinigen_prefill_cached_tokens", "prompt tokens restored from the "
                                             "prefix cache instead of prefilled", registry=r)
        self.decode_seconds = Counter("infinigen_decode_seconds", "worker time in decode steps (with joins and "
                                      "retires)", registry=r)
        self.decode_rows = Counter("infinigen_decode_rows", "rows decoded, summed over steps (/ steps: the mean "
                                   "batch)", registry=r)
        self.decode_steps = Counter("infinigen_decode_steps", "decode steps", registry=r)
        for name, doc, read in [
            ("infinigen_running_requests", "requests decoding or in prefill", lambda: engine.running),
            ("infinigen_waiting_requests", "requests waiting to be admitted", lambda: engine.waiting),
            ("infinigen_queue_depth", "requests waiting or running", lambda: engine.queue_depth),
            ("infinigen_pool_bytes", "bytes of KV cache held now (running batch and prefill)", lambda: engine.pool_bytes),
            ("infinigen_pool_limit_bytes", "the admission limit on them (--max-pool-bytes)",
             lambda: engine.max_pool_bytes),
            ("infinigen_decode_tokens_per_second", "decode tokens/s over the last second of decoding",
             lambda: engine.last["decode_tokens_per_s"]),
        ]:
            Gauge(name, doc, registry=r).set_function(read)
        r.register(PrefixCollector(engine))
        Gauge("infinigen_fetched_fraction", "share of past KV entries fetched per layer and step (running batch)",
              ["method"], registry=r).labels(engine.method).set_function(lambda: engine.last["fetched_fraction"])


class PrefixCollector:
    """The prefix cache's counters and sizes (runtime/prefix.py: PrefixStore.report), read when scraped; nothing when
    the server runs without one."""

    COUNTERS = (("hit_tokens", "prompt tokens found in the prefix cache"),
                ("miss_tokens", "prompt tokens looked up and not found"),
                ("memory_evictions", "blocks evicted from memory"), ("disk_evictions", "block files evicted from disk"),
                ("disk_hits", "blocks read from disk"), ("disk_errors", "unusable entries and failed writes"))
    GAUGES = (("memory_bytes", "bytes of blocks in memory"), ("memory_limit_bytes", "their limit now (the pool's "
              "budget less the running requests', up to --prefix-cache-bytes)"), ("memory_blocks", "blocks in memory"),
              ("disk_bytes", "bytes of block files on disk"))

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        store = getattr(self.engine, "prefix", None)
        if store is None:
            return
        report = store.report()
        for key, doc in self.COUNTERS:
            yield CounterMetricFamily(f"infinigen_prefix_cache_{key}", doc, value=report[key])
        for key, doc in self.GAUGES:
            yield GaugeMetricFamily(f"infinigen_prefix_cache_{key}", doc, value=report[key])
