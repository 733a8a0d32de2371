"""The engine's state as Ray Serve metrics (Prometheus, through Ray's metrics export), and where this node exports
them."""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.serve import metrics

from darts_dist.generation import Engine

logger = logging.getLogger(__name__)
METRICS_INTERVAL_S = 1.0


class EngineMetrics:
    """The engine's waiting and running sequences, generated tokens and tokens/s as Ray Serve metrics, read every
    METRICS_INTERVAL_S on a thread of their own; Serve tags them with the deployment and replica."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.waiting = metrics.Gauge("darts_serve_waiting_sequences", "sequences waiting to join the running batch")
        self.running = metrics.Gauge("darts_serve_running_sequences", "sequences in the running batch")
        self.tokens = metrics.Counter("darts_serve_generated_tokens", "tokens generated since the replica started")
        self.rate = metrics.Gauge("darts_serve_tokens_per_second", "tokens generated per second, last interval")
        self.cached = metrics.Gauge("darts_serve_prefix_cache_hit_ratio",
                                    "share of prompt tokens taken from the prefix cache since the replica started")
        self._stop = threading.Event()
        threading.Thread(target=self._report, name="darts-metrics", daemon=True).start()

    def _report(self) -> None:
        reported, then = 0, time.monotonic()
        while not self._stop.wait(METRICS_INTERVAL_S):
            try:
                reported, then = self._export(reported, then)
            except Exception:  # noqa: BLE001 - one failed reading must not end the replica's metrics
                logger.exception("engine metrics: a reading failed")

    def _export(self, reported: int, then: float) -> tuple[int, float]:
        """Set the metrics from the engine's stats; the tokens reported so far and when, for the next reading."""
        stats, now = self.engine.stats(), time.monotonic()
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        if stats.generated_tokens > reported:
            self.tokens.inc(stats.generated_tokens - reported)
        self.rate.set((stats.generated_tokens - reported) / (now - then))
        self.cached.set(stats.cached_prompt_tokens / max(1, stats.prompt_tokens))
        return stats.generated_tokens, now

    def close(self) -> None:
        self._stop.set()


def metrics_url() -> str:
    """Where Ray's metrics agent on this node exports Prometheus metrics, the replicas' darts_serve_* among them."""
    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeID"] == ray.get_runtime_context().get_node_id())
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
