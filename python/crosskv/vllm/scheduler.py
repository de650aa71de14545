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
from dataclasses import replace
from typing import Optional

import numpy as np

from vllm.logger import init_logger

from .context import EngineContext
from .guard import StoreGuard
from .layout import slots_of
from .metadata import (APPLIED, FALLBACK, LOCAL, MAPPED_CACHE, MAPPED_STATUSES, RECOMPUTED, RELOADED, CrossKVMetadata,
                       CrossKVWorkerMetadata, LoadPlan, Outcome, SavePlan, applied, fallback)
from .metrics import CrossKVStats, take_stats
from .saver import local_saver
from .store import ChunkRef, Match, PrefixError, header_mismatch, whole_header

logger = init_logger("vllm.crosskv")

_TAINTED_CAP = 1 << 20  # block hashes remembered as holding mapped KV (namespace policy), least recent dropped
LOOKUP_WAIT_PER_STEP_S = 0.01  # what one scheduler step may wait, in all, for new requests' lookups to answer


class SchedulerSide:
    def __init__(self, ctx: EngineContext):
        self.ctx = ctx
        self._outcomes: dict[str, Outcome] = {}
        # req_id -> (its stored chunks, tokens computed locally, the mapped prefix's end, its cache_salt)
        self._candidates: dict[str, tuple[list[ChunkRef], int, int, Optional[str]]] = {}
        self._to_load: dict[str, object] = {}
        self._to_save: list[SavePlan] = []
        self._mapped_span: dict[str, tuple[int, int]] = {}  # req_id -> tokens [first, end) of mapped KV it holds
        self._mapped_from: dict[str, int] = {}  # req_id -> its first block holding mapped KV (namespace policy)
        self._tainted: OrderedDict = OrderedDict()  # block hash -> None: blocks holding mapped KV, or KV after it
        self._stats = CrossKVStats()
        st = ctx.settings
        self.guard = StoreGuard(ctx.store.spec, st.breaker_failures, st.breaker_seconds)
        self._guard_opened = 0
        self._lookups: dict[str, tuple] = {}  # req_id -> (its lookup's future, when it started)
        self._wait_left = LOOKUP_WAIT_PER_STEP_S

    # --------------------------------------------------------------------------------------------------- lookup
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.ctx.role.maps:
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
        if ctx.refusal:
            self._outcomes[rid] = fallback(ctx.refusal.reason, ctx.refusal.kind)
            return 0, False
        preempted = getattr(request, "num_preemptions", 0)
        if preempted and rid in self._outcomes:  # resumed after a preemption freed its blocks
            return self._resume(request, num_computed_tokens, preempted)
        reused, tainted_from = self._mapped_cache_hit(request, num_computed_tokens)
        reused_outcome = Outcome(MAPPED_CACHE, tokens=reused, local_tokens=num_computed_tokens)
        if reused:  # its cache holds mapped KV up to here (a load below extends the span)
            self._mapped_span[rid] = (num_computed_tokens, num_computed_tokens)
        try:
            found = self._lookup(request)
        except PrefixError as e:  # the store cannot be read, in time or at all
            self._outcomes[rid] = fallback(str(e), e.kind)
            return 0, False
        if found is None:
            return None, False  # under way: vLLM asks again on a later step
        match, stopped = found
        n = match.tokens
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
        why = self._keep_apart(request, num_computed_tokens, tainted_from)
        if why:
            self._outcomes[rid] = fallback(why, "prefix_cache")
            return 0, False
        self._candidates[rid] = ([c for c in match.chunks if c.end > num_computed_tokens], num_computed_tokens, n,
                                 self._salt(request, self.ctx.settings.load_namespace))
        self._mapped_span[rid] = (num_computed_tokens, n)
        self._outcomes[rid] = applied(n - num_computed_tokens, n, ctx.settings.mapper,
                                      stopped[0] if stopped else None,
                                      **({"mapped_prefix_cache_tokens": reused} if reused else {}))
        return n - num_computed_tokens, False

    def _keep_apart(self, request, num_computed_tokens, tainted_from):
        """Keeps the blocks a load fills out of the exact prefix cache (or marks them for the namespace policy);
        returns why it cannot, or None."""
        if not self.ctx.prefix_caching:
            return None
        first_block = num_computed_tokens // self.ctx.block_size
        if self.ctx.settings.mapped_prefix_reuse == "none":
            return self._hash_apart(request, first_block)
        self._taint(request.block_hashes[first_block:])
        self._taint_later(request.request_id, first_block if tainted_from is None else tainted_from)
        return None

    def _resume(self, request, num_computed_tokens, preempted):
        """A preempted request's prefix, on its resume: the same KV again, or honestly its own. Its blocks held mapped
        KV for tokens [first, end): they are loaded again from the store when vLLM kept (in its prefix cache) every
        block before `first` and the store still holds the run up to `end`; its own mapped blocks found again in the
        prefix cache need nothing. Otherwise the target computes the prefix itself from here on (recomputed, with the
        reason). A request whose KV was its own stays its own."""
        rid, before = request.request_id, self._outcomes[request.request_id]
        if before.status not in MAPPED_STATUSES or rid not in self._mapped_span:
            self._outcomes[rid] = replace(before, preemptions=preempted)
            return 0, False
        first, end = self._mapped_span[rid]

        def recomputed(why, kind):
            self._outcomes[rid] = Outcome(RECOMPUTED, tokens=before.tokens, reason=why, kind=kind, preemptions=preempted,
                                          local_tokens=num_computed_tokens)
            self._mapped_span.pop(rid, None)
            return 0, False

        if num_computed_tokens < first:
            return recomputed(f"preempted, and the {first} tokens its prefix cache held before its mapped prefix were "
                              "evicted meanwhile", "preempted")
        if num_computed_tokens >= end:  # its own mapped blocks, found again
            self._outcomes[rid] = replace(before, status=MAPPED_CACHE, preemptions=preempted,
                                          local_tokens=num_computed_tokens)
            return 0, False
        try:
            found = self._lookup(request)
        except PrefixError as e:
            return recomputed(f"preempted, and its stored prefix could not be read again: {e}", e.kind)
        if found is None:
            return None, False
        match, _ = found
        if match.tokens < end:
            return recomputed(f"preempted, and the store holds {match.tokens} of its {end} mapped tokens now "
                              "(evicted, or removed)", "evicted")
        why = self._keep_apart(request, num_computed_tokens, None)
        if why:
            return recomputed(why, "prefix_cache")
        self._candidates[rid] = ([c for c in match.chunks if c.end > num_computed_tokens and c.start < end],
                                 num_computed_tokens, end, self._salt(request, self.ctx.settings.load_namespace))
        self._outcomes[rid] = replace(applied(end - num_computed_tokens, end, self.ctx.settings.mapper),
                                      status=RELOADED, preemptions=preempted)
        return end - num_computed_tokens, False

    def _lookup(self, request):
        """(the usable run of stored chunks, why it stops) of the request's prompt; None while its lookup is under way;
        PrefixError where the store did not answer in time, or is marked unhealthy."""
        rid, timeout = request.request_id, self.ctx.settings.lookup_timeout_ms / 1e3
        if rid not in self._lookups:
            tokens = list(request.prompt_token_ids or [])
            salt = self._salt(request, self.ctx.settings.load_namespace)
            self.guard.admit()
            # The last prompt token is always computed: it gives the first output token's logits.
            fut = self.guard.submit("be read", lambda: self._usable_run(self.ctx.store.match(tokens, len(tokens) - 1,
                                                                                             salt)), timeout)
            self._lookups[rid] = (fut, time.monotonic())
            t0 = time.monotonic()
            try:  # most lookups answer at once: no step is lost to asking again (within the step's budget)
                fut.result(timeout=max(0.0, min(timeout, self._wait_left)))
            except Exception:
                pass
            self._wait_left -= time.monotonic() - t0
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
                    why, kind = header_mismatch(meta, self.ctx.source_spec, self.ctx.tokenizer, self.ctx.source_weights,
                                                self.ctx.settings.accept_weights), "other_source"
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
        self._wait_left = LOOKUP_WAIT_PER_STEP_S  # the next step's lookups share this much waiting
        meta = CrossKVMetadata(saves=self._to_save)
        self._to_save = []
        planned = [(new.req_id, new.block_ids[0]) for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())
        # A request resumed after preemption lists all of its blocks (vLLM freed the ones it had).
        planned += [(rid, blocks[0]) for rid, blocks in zip(cached.req_ids, cached.new_block_ids)
                    if rid in resumed and blocks is not None]
        for rid, block_ids in planned:
            request = self._to_load.pop(rid, None)
            if request is None:
                continue
            chunks, first, end, salt = self._candidates[rid]
            meta.loads.append(LoadPlan(rid, chunks, first, end, list(request.all_token_ids[:end]),
                                       slots_of(block_ids, self.ctx.block_size, first, end).tolist(), salt))
        # Every request promised external tokens is scheduled in the step that allocated it, as new or resumed.
        assert not self._to_load, f"crosskv: loads promised but not scheduled: {sorted(self._to_load)}"
        return meta

    def update_connector_output(self, connector_output):
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, CrossKVWorkerMetadata):
            # A failed load is known before its request can finish (vLLM recomputes its blocks first); a request
            # that finished in the step that loaded it already returned its outcome.
            for rid, got in wm.outcomes.items():
                mine = self._outcomes.get(rid)
                if mine is None:
                    continue
                if mine.preemptions and got.status == FALLBACK:  # its reload failed: it computes the prefix itself
                    got = Outcome(RECOMPUTED, reason=got.reason, kind=got.kind, preemptions=mine.preemptions)
                    self._mapped_span.pop(rid, None)
                elif mine.preemptions:  # the worker's figures, the life's label
                    got = replace(got, status=mine.status, preemptions=mine.preemptions)
                self._outcomes[rid] = got

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._candidates.pop(rid, None)
        self._lookups.pop(rid, None)
        self._mapped_span.pop(rid, None)
        self._to_load.pop(rid, None)
        saved = self._plan_save(request, block_ids) if self.ctx.role.saves else None
        if not self.ctx.role.maps:
            # The blocks are kept until the workers' savers have copied them out; the store write comes after.
            return (True, {"crosskv": {"status": "save_queued", "tokens": saved}}) if saved else (False, None)
        outcome = self._outcomes.pop(rid, fallback("never scheduled through the connector", "other"))
        first_block = self._mapped_from.pop(rid, None)
        if first_block is not None and outcome.status not in (FALLBACK, RECOMPUTED):  # every block it filled holds mapped KV
            self._taint(request.block_hashes[first_block:])
        self._stats.record_outcome(outcome.klass, outcome.tokens if outcome.status in (APPLIED, RELOADED) else 0)
        logger.info("crosskv: request %s: %s", rid, outcome.line())
        return bool(saved), {"crosskv": {**outcome.params(), **({"saved_tokens": saved} if saved else {})}}

    def _plan_save(self, request, block_ids) -> int:
        """A finished request's save handed to the saver (at once, where the engine's only worker is in this
        process; else in the next step's metadata); the tokens it saves, 0 where none."""
        # The tokens whose KV is in the cache: under async scheduling, the next step's may not be written yet.
        n = request.num_computed_tokens - max(0, getattr(request, "num_in_flight_tokens", 0))
        if not self.ctx.settings.save_replies:
            n = min(n, len(request.prompt_token_ids or []))
        if self.ctx.unmappable or n < self.ctx.settings.min_prefix_tokens or not block_ids:
            return 0
        plan = SavePlan(request.request_id, list(request.all_token_ids[:n]),
                        slots_of(block_ids, self.ctx.block_size, 0, n).tolist(),
                        self._salt(request, self.ctx.settings.save_namespace))
        saver = self._local_saver()
        if saver is not None:  # this process holds the engine's only worker: saved now, no further step needed
            saver.save(plan)
        else:  # the workers take it in the next step's metadata
            self._to_save.append(plan)
        return n

    @staticmethod
    def _salt(request, model_namespace: Optional[str]) -> Optional[str]:
        """The request's namespace in the store: its cache_salt, under the model's namespace where one is set."""
        salt = getattr(request, "cache_salt", None)
        if not model_namespace:
            return salt
        return f"@{model_namespace}" + (f"/{salt}" if salt else "")

    def _local_saver(self):
        """The engine's only worker, where it lives in this process (it then saves a finished request at once)."""
        return local_saver(self.ctx.engine_id)

    def get_kv_connector_stats(self):
        return take_stats(self)
