"""What the scheduler side tells the workers each step (loads and saves), what the workers tell it back (each
request's outcome), and the outcomes themselves."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

# A request's outcome over its whole life: the stored prefix mapped; re-prefilled (with the reason and its class); the
# target's own prefix cache held at least as much exact KV; or it held mapped KV that this request reused
# (mapped_prefix_reuse: namespace, or the request's own blocks found again after a preemption). A mapped request that
# was preempted either loaded its mapped prefix again (reloaded: the same KV, so the same output) or computed it
# itself (recomputed: the target's own continuation from there on, with the reason).
APPLIED, FALLBACK, LOCAL, MAPPED_CACHE = "applied", "fallback_reprefill", "local_prefix_cache", "mapped_prefix_cache"
RELOADED, RECOMPUTED = "reloaded_after_preemption", "recomputed_after_preemption"
MAPPED_STATUSES = (APPLIED, RELOADED, MAPPED_CACHE)  # the request's cache holds mapped KV


@dataclass
class Outcome:
    """A target request's outcome, as the log, the metrics and its kv_transfer_params["crosskv"] report it."""
    status: str
    tokens: int = 0  # mapped (applied), or held by the target's own cache (local, mapped cache)
    reason: Optional[str] = None  # fallback: why
    kind: Optional[str] = None  # fallback: the reason's class, for the metrics
    prefix_tokens: Optional[int] = None  # applied, local: where the stored prefix ends
    mapper: Optional[str] = None  # applied
    map_ms: Optional[float] = None  # applied, from the worker that mapped it
    stopped: Optional[str] = None  # applied: why the stored run was cut before its planned end
    mapped_prefix_cache_tokens: Optional[int] = None  # applied after reusing mapped KV from the prefix cache
    local_tokens: Optional[int] = None  # mapped cache: the tokens the target's cache held
    preemptions: Optional[int] = None  # times the request was preempted (set once it was)

    def __post_init__(self):
        self.preemptions = self.preemptions or None

    def params(self) -> dict:
        """The fields that are set, for kv_transfer_params (a fallback carries no token count)."""
        return {k: v for k, v in asdict(self).items()
                if v is not None and not (k == "tokens" and self.status in (FALLBACK, RECOMPUTED))}

    @property
    def klass(self) -> str:
        """The metrics' class: the status, and a fallback's kind."""
        return f"{self.status}:{self.kind or 'other'}" if self.status in (FALLBACK, RECOMPUTED) else self.status

    def line(self) -> str:
        """One line for the log."""
        preempted = f" (preempted {self.preemptions} times)" if self.preemptions else ""
        return self._line() + preempted

    def _line(self) -> str:
        if self.status in (APPLIED, RELOADED):
            reused = (f" (after {self.mapped_prefix_cache_tokens} reused from the mapped prefix cache)"
                      if self.mapped_prefix_cache_tokens else "")
            stopped = f" (the stored run stops at {self.stopped})" if self.stopped else ""
            return f"{self.status}: {self.tokens} tokens mapped by {self.mapper}{reused}{stopped}"
        if self.status == LOCAL:
            return f"{LOCAL}: the target's own cache holds {self.tokens} tokens, the store {self.prefix_tokens}"
        if self.status == MAPPED_CACHE:
            return f"{MAPPED_CACHE}: {self.tokens} tokens of mapped KV reused from the target's prefix cache"
        return f"{self.status}: {self.reason or ''}"


def fallback(reason: str, kind: str) -> Outcome:
    """A re-prefill outcome; `kind` is the reason's class, for the metrics (no_prefix, missing, damaged, incomplete,
    other_source, not_finite, mapper, not_ready, uncertain, unmappable_model, prefix_cache, preempted, worker_error)."""
    return Outcome(FALLBACK, reason=reason, kind=kind)


def applied(tokens: int, prefix_tokens: int, mapper: Optional[str], stopped: Optional[str] = None,
            **extra) -> Outcome:
    """An applied outcome: `tokens` mapped, the prefix's end, the mapper; where the stored run was cut (`stopped`)."""
    return Outcome(APPLIED, tokens=tokens, prefix_tokens=prefix_tokens, mapper=mapper, stopped=stopped, **extra)


def failure_kind(e: BaseException) -> str:
    """The fallback class of an exception on the worker's path."""
    from .. import MapperError

    kind = getattr(e, "kind", None)  # the store's PrefixError
    if kind:
        return kind
    if isinstance(e, MapperError):
        return "not_finite" if ("NaN" in str(e) or "infinity" in str(e)) else "mapper"
    return "worker_error"


@dataclass
class LoadPlan:
    req_id: str
    chunks: list  # the store's ChunkRefs that hold tokens [first, end), in order
    first: int  # tokens [first, end) are loaded; [0, first) the target's own prefix cache holds
    end: int
    token_ids: list[int]  # [0, end), to check the stored chunks against
    slots: list[int]  # of tokens [first, end)
    salt: Optional[str] = None  # the request's cache_salt: its namespace in the store
    stopped: Optional[str] = None  # why the run was cut before its planned end (a chunk that could not be used)


@dataclass
class SavePlan:
    req_id: str
    token_ids: list[int]
    slots: list[int]
    salt: Optional[str] = None


@dataclass
class CrossKVMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass
class CrossKVWorkerMetadata(KVConnectorWorkerMetadata):
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # req_id -> outcome

    def aggregate(self, other):
        merged = dict(self.outcomes)
        for req, o in other.outcomes.items():  # one worker's failure fails the request; the fewest tokens mapped win
            if req not in merged or o.status == FALLBACK or (
                    o.status == merged[req].status == APPLIED and o.tokens < merged[req].tokens):
                merged[req] = o
        return CrossKVWorkerMetadata(merged)
