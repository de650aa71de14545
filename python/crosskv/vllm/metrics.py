"""The connector's metrics, through vLLM's connector-stats interface: the scheduler side counts requests by outcome
(applied, each fallback class, local_prefix_cache, mapped_prefix_cache) and the tokens mapped; each worker records
how long each prefix took to map. vLLM aggregates them across workers and steps, logs them, and publishes them on
the OpenAI server's /metrics as vllm:crosskv_requests_total{outcome=...}, vllm:crosskv_mapped_tokens_total and
vllm:crosskv_map_seconds."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


@dataclass
class CrossKVStats(KVConnectorStats):
    """data: {"outcomes": {class: count}, "mapped_tokens": int, "map_s": [seconds per prefix and worker]}."""

    def __post_init__(self):
        self.data.setdefault("outcomes", {})
        self.data.setdefault("mapped_tokens", 0)
        self.data.setdefault("map_s", [])

    def reset(self):
        self.data = {"outcomes": {}, "mapped_tokens": 0, "map_s": []}

    def record_outcome(self, outcome_class: str, mapped_tokens: int = 0):
        self.data["outcomes"][outcome_class] = self.data["outcomes"].get(outcome_class, 0) + 1
        self.data["mapped_tokens"] += mapped_tokens

    def record_map(self, seconds: float):
        self.data["map_s"].append(seconds)

    def aggregate(self, other):
        out = {"outcomes": dict(self.data["outcomes"]), "mapped_tokens": self.data["mapped_tokens"],
               "map_s": list(self.data["map_s"])}
        for k, n in other.data.get("outcomes", {}).items():
            out["outcomes"][k] = out["outcomes"].get(k, 0) + n
        out["mapped_tokens"] += other.data.get("mapped_tokens", 0)
        out["map_s"] += other.data.get("map_s", [])
        return CrossKVStats(out)

    def reduce(self):
        m = self.data["map_s"]
        return {**{f"requests[{k}]": n for k, n in sorted(self.data["outcomes"].items())},
                "mapped_tokens": self.data["mapped_tokens"], "maps": len(m),
                "map_ms_mean": round(1e3 * sum(m) / len(m), 3) if m else 0.0}

    def is_empty(self):
        return not (self.data["outcomes"] or self.data["mapped_tokens"] or self.data["map_s"])


class CrossKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._requests = self._counter_cls(name="vllm:crosskv_requests",
                                           documentation="Target requests by crosskv outcome (applied, "
                                                         "fallback_reprefill:<class>, local_prefix_cache, "
                                                         "mapped_prefix_cache)",
                                           labelnames=labelnames + ["outcome"])
        self._tokens = self._counter_cls(name="vllm:crosskv_mapped_tokens",
                                         documentation="Prompt tokens whose KV crosskv mapped from a stored source "
                                                       "prefix", labelnames=labelnames)
        self._map_s = self._histogram_cls(name="vllm:crosskv_map_seconds",
                                          documentation="Seconds to read, check and map one stored prefix, per worker",
                                          buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                                   5.0],
                                          labelnames=labelnames)

    def observe(self, transfer_stats_data, engine_idx=0):
        labels = self.per_engine_labelvalues[engine_idx]
        for outcome, n in transfer_stats_data.get("outcomes", {}).items():
            self._requests.labels(*labels, outcome).inc(n)
        if transfer_stats_data.get("mapped_tokens"):
            self._tokens.labels(*labels).inc(transfer_stats_data["mapped_tokens"])
        for s in transfer_stats_data.get("map_s", []):
            self._map_s.labels(*labels).observe(s)
