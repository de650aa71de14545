"""The connector's scheduler side: finds each new target request's longest run of stored chunks (cut before the first
one that cannot feed the mapper), decides its outcome, keeps mapped KV out of the exact prefix cache (or within its
namespace), and counts outcomes for the metrics. On the source engine it plans the saves of finished requests.

The lookup never holds up the scheduler's loop: it runs on the store guard's threads. While it is under way the
request is asked about again on a later step (get_num_new_matched_tokens returns None: vLLM's "ask again later");
past lookup_timeout_ms, or while the store is marked unhealthy, the request re-prefills (store_timeout,
store_unhealthy)."""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Optional

import numpy as np

from vllm.logger import init_logger

from .context import EngineContext
from .guard import StoreGuard
from .layout import slots_of
from .metadata import (APPLIED, FALLBACK, LOCAL, MAPPED_CACHE, CrossKVMetadata, CrossKVWorkerMetadata, LoadPlan,
                       Outcome, SavePlan, applied, fallback)
from .metrics import CrossKVStats, take_stats
from .store import ChunkRef, Match, PrefixError, header_mismatch, whole_header

logger = init_logger("vllm.crosskv")

_TAINTED_CAP = 1 << 20  # block hashes remembered as holding mapped KV (namespace policy), least recent dropped


class SchedulerSide:
    def __init__(self, ctx: EngineContext):
        self.ctx = ctx
        self._outcomes: dict[str, Outcome] = {}
        # req_id -> (its stored chunks, tokens computed locally, the mapped prefix's end, its cache_salt)
        self._candidates: dict[str, tuple[list[ChunkRef], int, int, Optional[str]]] = {}
        self._to_load: dict[str, object] = {}
        self._to_save: list[SavePlan] = []
        self._mapped_from: dict[str, int] = {}  # req_id -> its first block holding mapped KV (namespace policy)
        self._tainted: OrderedDict = OrderedDict()  # block hash -> None: blocks holding mapped KV, or KV after it
        self._stats = CrossKVStats()
        st = ctx.settings
        self.guard = StoreGuard(ctx.store.spec, st.breaker_failures, st.breaker_seconds)
        self._guard_opened = 0
        self._lookups: dict[str, tuple] = {}  # req_id -> (its lookup's future, when it started)

    # --------------------------------------------------------------------------------------------------- lookup
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self.ctx.side == "source":
            return 0, False
        try:
            return self._match(request, num_computed_tokens)
        except Exception as e:  # anything unforeseen re-prefills this request; the engine goes on
            logger.exception("crosskv: request %s: the prefix lookup failed", request.request_id)
            self._outcomes[request.request_id] = fallback(f"the prefix lookup failed: {type(e).__name__}: {e}",
                                                          "worker_error")
            return 0, False

    def _match(self, request, num_computed_tokens):
        rid, ctx = request.request_id, self.ctx
        if ctx.unusable:
            self._outcomes[rid] = fallback(ctx.unusable, ctx.unusable_kind)
            return 0, False
        reused, tainted_from = self._mapped_cache_hit(request, num_computed_tokens)
        reused_outcome = Outcome(MAPPED_CACHE, tokens=reused, local_tokens=num_computed_tokens)
        try:
            found = self._lookup(request)
        except PrefixError as e:  # the store cannot be read, in time or at all
            self._outcomes[rid] = fallback(str(e), e.kind)
            return 0, False
        if found is None:
            return None, False  # under way: vLLM asks again on a later step
        match, stopped = found
        n, salt = match.tokens, getattr(request, "cache_salt", None)
        if n == 0 or n < ctx.settings.min_prefix_tokens:
            if stopped:
                self._outcomes[rid] = fallback(f"the stored prefix cannot be used: {stopped[0]}", stopped[1])
            else:
                self._outcomes[rid] = reused_outcome if reused else fallback(
                    "no stored prefix of this request" + (f" of at least {ctx.settings.min_prefix_tokens} tokens"
                                                          if n else " (never saved, evicted, or another namespace)"),
                    "no_prefix")
                self._taint_later(rid, tainted_from)
            return 0, False
        if n <= num_computed_tokens:
            self._outcomes[rid] = reused_outcome if reused else Outcome(LOCAL, tokens=num_computed_tokens,
                                                                        prefix_tokens=n)
            self._taint_later(rid, tainted_from)
            return 0, False
        first_block = num_computed_tokens // ctx.block_size
        if ctx.prefix_caching:
            if ctx.settings.mapped_prefix_reuse == "none":
                why = self._hash_apart(request, first_block)
                if why:
                    self._outcomes[rid] = fallback(why, "prefix_cache")
                    return 0, False
            else:
                self._taint(request.block_hashes[first_block:])
                self._taint_later(rid, first_block if tainted_from is None else tainted_from)
        chunks = [c for c in match.chunks if c.end > num_computed_tokens]
        self._candidates[rid] = (chunks, num_computed_tokens, n, salt)
        self._outcomes[rid] = applied(n - num_computed_tokens, n, ctx.settings.mapper,
                                      stopped[0] if stopped else None,
                                      **({"mapped_prefix_cache_tokens": reused} if reused else {}))
        return n - num_computed_tokens, False

    def _lookup(self, request):
        """(the usable run of stored chunks, why it stops) of the request's prompt; None while its lookup is under way;
        PrefixError where the store did not answer in time, or is marked unhealthy."""
        rid, timeout = request.request_id, self.ctx.settings.lookup_timeout_ms / 1e3
        if rid not in self._lookups:
            tokens = list(request.prompt_token_ids or [])
            salt = getattr(request, "cache_salt", None)
            self.guard.admit()
            # The last prompt token is always computed: it gives the first output token's logits.
            fut = self.guard.submit("be read", lambda: self._usable_run(self.ctx.store.match(tokens, len(tokens) - 1,
                                                                                             salt)), timeout)
            self._lookups[rid] = (fut, time.monotonic())
            try:  # most lookups answer at once: no step is lost to asking again
                fut.result(timeout=min(timeout, 0.01))
            except Exception:
                pass
        fut, started = self._lookups[rid]
        if not fut.done():
            if time.monotonic() - started < timeout:
                return None
            del self._lookups[rid]
            self.guard.failed(f"a lookup took over {timeout * 1e3:.0f} ms")
            raise PrefixError(f"the store at {self.ctx.store.spec} did not answer the lookup within "
                              f"{timeout * 1e3:.0f} ms (lookup_timeout_ms)", "store_timeout")
        del self._lookups[rid]
        return fut.result()

    def _usable_run(self, match: Match):
        """The run of chunks cut before the first whose parts are incomplete or disagree, or that cannot feed this
        mapper (another source model, RoPE or tokenizer); with (why it stops, its kind) where it was cut."""
        store = self.ctx.store
        for i, (ref, parts) in enumerate(zip(match.chunks, store.headers(match.chunks))):
            where = store.where(ref)
            if not parts:  # evicted since the lookup
                why, kind = f"{where}: no longer stored (evicted, or removed)", "evicted"
            else:
                try:
                    meta = whole_header(where, parts)
                    why, kind = header_mismatch(meta, self.ctx.source_spec, self.ctx.tokenizer), "other_source"
                    why = why and f"{where}: {why}"
                except PrefixError as e:
                    why, kind = str(e), e.kind
            if why:
                kept = match.chunks[:i]
                return Match(kept, min(match.tokens, kept[-1].end) if kept else 0), (why, kind)
        return match, None

    # ------------------------------------------------------------------------------- mapped KV and the prefix cache
    def _hash_apart(self, request, first_block: int):
        """mapped_prefix_reuse none: the request's block hashes from its first mapped block on are chained through
        a marker unique to this request, so the blocks it fills (mapped, and computed after them) are cached where
        no later lookup finds them. Returns why it cannot, or None."""
        bh = request.block_hashes
        if len(bh) != request.num_tokens // self.ctx.block_size:
            return (f"the engine hashes its prefix cache in blocks of another size than its {self.ctx.block_size}-"
                    "token blocks; mapped KV could not be kept out of it")
        marker = f"crosskv-mapped\0{request.request_id}".encode()
        tokens = request.all_token_ids
        bs = self.ctx.block_size
        for i in range(first_block, len(bh)):
            parent = bytes(bh[i - 1]) if i else b""
            block = np.asarray(tokens[i * bs:(i + 1) * bs], dtype=np.int64).tobytes()
            bh[i] = type(bh[i])(hashlib.sha256(marker + parent + block).digest())
        return None

    def _mapped_cache_hit(self, request, num_computed_tokens):
        """(tokens, first block) of the request's local prefix-cache hit that holds mapped KV (namespace policy);
        (0, None) where none does."""
        if not self._tainted or not num_computed_tokens:
            return 0, None
        bs = self.ctx.block_size
        for i, h in enumerate(request.block_hashes[:num_computed_tokens // bs]):
            if h in self._tainted:
                return num_computed_tokens - i * bs, i
        return 0, None

    def _taint(self, hashes):
        for h in hashes:
            self._tainted[h] = None
            self._tainted.move_to_end(h)
        while len(self._tainted) > _TAINTED_CAP:
            self._tainted.popitem(last=False)

    def _taint_later(self, rid, first_block):
        if first_block is not None:
            self._mapped_from[rid] = first_block

    # ------------------------------------------------------------------------------------------- the step's plan
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0 and request.request_id in self._candidates:
            self._to_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output):
        meta = CrossKVMetadata(saves=self._to_save)
        self._to_save = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._to_load:
                continue
            chunks, first, end, salt = self._candidates[new.req_id]
            meta.loads.append(LoadPlan(new.req_id, chunks, first, end, list(new.prompt_token_ids[:end]),
                                       slots_of(new.block_ids[0], self.ctx.block_size, first, end).tolist(), salt))
            del self._to_load[new.req_id]
        for rid in list(self._to_load):  # resumed after preemption: vLLM recomputes; say so
            self._outcomes[rid] = fallback("preempted before its prefix was loaded", "preempted")
            del self._to_load[rid]
        return meta

    def update_connector_output(self, connector_output):
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, CrossKVWorkerMetadata):
            # A failed load is known before its request can finish (vLLM recomputes its blocks first); a request
            # that finished in the step that loaded it already returned its outcome.
            self._outcomes.update({r: o for r, o in wm.outcomes.items() if r in self._outcomes})

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._candidates.pop(rid, None)
        self._lookups.pop(rid, None)
        if self.ctx.side == "source":
            n = request.num_computed_tokens
            if self.ctx.unusable or n < self.ctx.settings.min_prefix_tokens or not block_ids:
                return False, None
            self._to_save.append(SavePlan(rid, list(request.all_token_ids[:n]),
                                          slots_of(block_ids, self.ctx.block_size, 0, n).tolist(),
                                          getattr(request, "cache_salt", None)))
            # The blocks are kept until the workers' savers have copied them out; the store write comes after.
            return True, {"crosskv": {"status": "save_queued", "tokens": n}}
        outcome = self._outcomes.pop(rid, fallback("never scheduled through the connector", "other"))
        first_block = self._mapped_from.pop(rid, None)
        if first_block is not None and outcome.status != FALLBACK:  # every block it filled holds mapped KV
            self._taint(request.block_hashes[first_block:])
        self._stats.record_outcome(outcome.klass, outcome.tokens if outcome.status == APPLIED else 0)
        logger.info("crosskv: request %s: %s", rid, outcome.line())
        return False, {"crosskv": outcome.params()}

    def get_kv_connector_stats(self):
        return take_stats(self)
