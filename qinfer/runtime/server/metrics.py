"""The server's Prometheus metrics (prometheus_client), named as llama.cpp's server names its own under
`llamacpp:`: tokens in and out, the last request's speeds, requests running and waiting, KV rows in use. One
registry per app, so that two servers in one process (tests) count apart."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from qinfer.runtime.engine.worker import EngineWorker

PREFIX = "qinfer_"


class ServerMetrics:
    def __init__(self, worker: EngineWorker):
        self.registry = CollectorRegistry()

        def gauge(name: str, doc: str, read: Callable[[], float] | None = None) -> Gauge:
            g = Gauge(PREFIX + name, doc, registry=self.registry)
            if read is not None:
                g.set_function(read)
            return g

        self.requests = Counter(PREFIX + "requests", "Requests answered.", registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", registry=self.registry)
        self.predicted_tokens = Counter(
            PREFIX + "tokens_predicted", "Tokens generated.", registry=self.registry
        )
        self.prompt_speed = gauge("prompt_tokens_seconds", "Prompt tokens/s of the last request.")
        self.predicted_speed = gauge("predicted_tokens_seconds", "Generated tokens/s of the last request.")
        gauge("requests_processing", "Requests in a slot.", lambda: worker.stats()["busy_slots"])
        gauge("requests_deferred", "Requests waiting for a slot.", lambda: worker.stats()["waiting"])
        gauge("kv_cache_tokens", "KV-cache rows holding a running request's token, all slots.",
              lambda: worker.engine.rows_in_use())  # fmt: skip
        gauge("kv_cache_usage_ratio", "Share of the KV cache's rows in use.",
              lambda: worker.engine.rows_in_use() / (worker.engine.slots * worker.engine.ctx_size))  # fmt: skip

    def answered(self, prompt_tokens: int, predicted_tokens: int, prompt_s: float, predicted_s: float) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.predicted_tokens.inc(predicted_tokens)
        if prompt_s > 0:
            self.prompt_speed.set(prompt_tokens / prompt_s)
        if predicted_s > 0:
            self.predicted_speed.set(predicted_tokens / predicted_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
