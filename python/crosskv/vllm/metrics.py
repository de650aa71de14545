"""The connector's metrics, through vLLM's connector-stats interface: the scheduler side counts requests by outcome
(applied, reloaded_after_preemption, each recomputed_after_preemption and fallback class, local_prefix_cache,
mapped_prefix_cache) and the tokens mapped; each worker records
how long each prefix took to map, and, on a source, each save's outcome (stored, shared, dropped, failed,
abandoned), its seconds from the step to the store, and the bytes queued; both sides record the times their store was
marked unhealthy. vLLM aggregates them across workers and steps, logs them, and publishes them on the OpenAI
server's /metrics as vllm:crosskv_requests_total{outcome=...}, vllm:crosskv_mapped_tokens_total,
vllm:crosskv_map_seconds, vllm:crosskv_saves_total{outcome=...}, vllm:crosskv_save_seconds and
vllm:crosskv_store_unhealthy_total."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


@dataclass
class CrossKVStats(KVConnectorStats):
    """data: {"outcomes": {class: count}, "mapped_tokens": int, "map_s": [seconds per prefix and worker]}."""

    def __post_init__(self):
        for key, empty in _EMPTY.items():
            self.data.setdefault(key, empty())

    def reset(self):
        self.data = {key: empty() for key, empty in _EMPTY.items()}

    def record_saves(self, counts: dict, seconds: list, queued_bytes: int):
        for k, n in counts.items():
            self.data["saves"][k] = self.data["saves"].get(k, 0) + n
        self.data["save_s"] += seconds
        self.data["save_queue_bytes"] = max(self.data["save_queue_bytes"], queued_bytes)

    def record_store(self, state: str, opened: int):
        self.data["store_unhealthy"] += opened
        if state != "healthy":
            self.data["store_state"] = state

    def record_outcome(self, outcome_class: str, mapped_tokens: int = 0):
        self.data["outcomes"][outcome_class] = self.data["outcomes"].get(outcome_class, 0) + 1
        self.data["mapped_tokens"] += mapped_tokens

    def record_map(self, seconds: float):
        self.data["map_s"].append(seconds)

    def aggregate(self, other):
        a, b = self.data, {key: other.data.get(key, empty()) for key, empty in _EMPTY.items()}
        out = {"outcomes": dict(a["outcomes"]), "saves": dict(a["saves"]),
               "mapped_tokens": a["mapped_tokens"] + b["mapped_tokens"], "map_s": a["map_s"] + b["map_s"],
               "save_s": a["save_s"] + b["save_s"], "store_unhealthy": a["store_unhealthy"] + b["store_unhealthy"],
               "save_queue_bytes": max(a["save_queue_bytes"], b["save_queue_bytes"]),
               "store_state": a["store_state"] or b["store_state"]}
        for key in ("outcomes", "saves"):
            for k, n in b[key].items():
                out[key][k] = out[key].get(k, 0) + n
        return CrossKVStats(out)

    def reduce(self):
        m, s = self.data["map_s"], self.data["save_s"]
        out = {**{f"requests[{k}]": n for k, n in sorted(self.data["outcomes"].items())},
               "mapped_tokens": self.data["mapped_tokens"], "maps": len(m),
               "map_ms_mean": round(1e3 * sum(m) / len(m), 3) if m else 0.0}
        if self.data["saves"] or s:
            out.update({f"saves[{k}]": n for k, n in sorted(self.data["saves"].items())})
            out["save_ms_mean"] = round(1e3 * sum(s) / len(s), 3) if s else 0.0
            out["save_queue_mib"] = round(self.data["save_queue_bytes"] / 2**20, 1)
        if self.data["store_unhealthy"] or self.data["store_state"]:
            out["store_unhealthy"] = self.data["store_unhealthy"]
            out["store_state"] = self.data["store_state"] or "healthy"
        return out

    def is_empty(self):
        d = self.data
        return not (d["outcomes"] or d["mapped_tokens"] or d["map_s"] or d["saves"] or d["save_s"]
                    or d["store_unhealthy"] or d["store_state"])


_EMPTY = {"outcomes": dict, "mapped_tokens": int, "map_s": list, "saves": dict, "save_s": list,
          "save_queue_bytes": int, "store_unhealthy": int, "store_state": str}


def take_stats(side) -> "CrossKVStats | None":
    """A connector side's stats since the last call, with its store guard's state (None when there is nothing):
    `side` holds `_stats`, `guard` and `_guard_opened` (the scheduler's and the workers' alike)."""
    opened, side._guard_opened = side.guard.opened - side._guard_opened, side.guard.opened
    side._stats.record_store(side.guard.state, opened)
    if side._stats.is_empty():
        return None
    out, side._stats = side._stats, CrossKVStats()
    return out


class CrossKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._requests = self._counter_cls(name="vllm:crosskv_requests",
                                           documentation="Target requests by crosskv outcome over their "
                                                         "whole life (applied, reloaded_after_preemption, "
                                                         "recomputed_after_preemption:<class>, "
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

        self._saves = self._counter_cls(name="vllm:crosskv_saves",
                                        documentation="Source requests' KV saves by outcome (stored, shared: every "
                                                      "chunk already stored, dropped: the save queue was full, "
                                                      "failed, abandoned at shutdown)",
                                        labelnames=labelnames + ["outcome"])
        self._save_s = self._histogram_cls(name="vllm:crosskv_save_seconds",
                                           documentation="Seconds from a request's finish to its KV in the store, per "
                                                         "saving worker",
                                           buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0],
                                           labelnames=labelnames)
        self._unhealthy = self._counter_cls(name="vllm:crosskv_store_unhealthy",
                                            documentation="Times the prefix store was marked unhealthy (not asked "
                                                          "for a back-off period)", labelnames=labelnames)

    def observe(self, transfer_stats_data, engine_idx=0):
        labels = self.per_engine_labelvalues[engine_idx]
        for outcome, n in transfer_stats_data.get("outcomes", {}).items():
            self._requests.labels(*labels, outcome).inc(n)
        if transfer_stats_data.get("mapped_tokens"):
            self._tokens.labels(*labels).inc(transfer_stats_data["mapped_tokens"])
        for s in transfer_stats_data.get("map_s", []):
            self._map_s.labels(*labels).observe(s)
        for outcome, n in transfer_stats_data.get("saves", {}).items():
            self._saves.labels(*labels, outcome).inc(n)
        for s in transfer_stats_data.get("save_s", []):
            self._save_s.labels(*labels).observe(s)
        if transfer_stats_data.get("store_unhealthy"):
            self._unhealthy.labels(*labels).inc(transfer_stats_data["store_unhealthy"])
