"""The connector's worker side, one per tensor-parallel worker. A target worker maps, for each planned load, the
stored source prefix into exactly the KV heads it holds (crosskv.Mapper with target_heads) and writes them through
the attention backend's own cache writer in the model's dtype (an fp8 cache's writer quantizes with the layer's
scales). A source worker saves the KV heads it holds as one part of each finished request's prefix. Nothing on this
path takes the engine down: any failure makes that request's blocks a load error, recomputed, with the reason."""
from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from vllm.logger import init_logger

from .. import Mapper, MapperError
from .config import CrossKVConfigError
from .context import EngineContext, Refusal
from .guard import StoreGuard
from .layout import HeadPlacement, PagedLayout, head_placement, layer_scales
from .metadata import (CrossKVMetadata, CrossKVWorkerMetadata, LoadPlan, Outcome, SavePlan, applied, failure_kind,
                       fallback)
from .metrics import CrossKVStats, take_stats
from .saver import LOCAL_SAVERS, Saver, SaveJob
from .store import FP8_DTYPES, PrefixError

logger = init_logger("vllm.crosskv")

MAP_AHEAD_LAYERS = 2  # layers the mapping thread may hold mapped before the forward writes them (device memory)
SAVE_COPY_BYTES = 64 << 20  # a save's device-side gather, per K or V, at most: one layer's tokens in pieces this big


# --------------------------------------------------------------------------------------------------- the mapping
@dataclass
class SourcePrefix:
    """A load's stored prefix, read and checked, on the mapper's side: source keys and values [tokens, Ls, Hs, Ds]
    and their positions."""
    plan: LoadPlan
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    read_s: float  # seconds to read, check and place it


class LayerByLayer:
    """Maps the step's prefixes one target layer at a time on a thread of its own, so that mapping layer l overlaps
    the model's compute of the layers before it; wait(l) hands over layer l's (plan, keys, values) for each prefix
    whose mapping has not failed, and forgets them. The thread runs at most `ahead` layers before the forward, so the
    mapped KV on the device is a few layers', never the request's. On a GPU the mapping runs on a side stream, and
    wait(l) orders the caller's stream after it. A prefix whose mapping fails at any layer is reported through
    `failed` (its blocks are then recomputed, so the layers written before the failure are overwritten). close()
    ends the thread even where the forward skipped layers."""

    def __init__(self, mapper: Mapper, prefixes: list[SourcePrefix], n_layers: int, device: torch.device,
                 ahead: int = MAP_AHEAD_LAYERS):
        self.mapper, self.prefixes, self.n_layers = mapper, prefixes, n_layers
        self._room = threading.Semaphore(ahead)  # ahead + layers the forward has passed - layers mapped
        self._passed = 0  # the forward has passed layers [0, _passed): taken, or skipped
        self._stop = False
        self.failed: dict[str, str] = {}  # req_id -> reason
        self.kinds: dict[str, str] = {}  # req_id -> the reason's class
        self.map_s: dict[str, float] = {}  # req_id -> seconds of mapping
        self._done = [threading.Event() for _ in range(n_layers)]
        self._out: list[list] = [[] for _ in range(n_layers)]
        self._cuda_events: list[Optional[torch.cuda.Event]] = [None] * n_layers
        self._side = None
        if device.type == "cuda":
            self._side = torch.cuda.Stream(device)
            self._side.wait_stream(torch.cuda.current_stream(device))  # the prefixes were uploaded on it
        self._thread = threading.Thread(target=self._run, name="crosskv-map", daemon=True)
        self._thread.start()

    def _run(self):
        try:
            with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
                for li in range(self.n_layers):
                    self._room.acquire()
                    if self._stop:
                        break
                    if li < self._passed:  # the forward went past it without taking it
                        self._done[li].set()
                        continue
                    self._map_layer(li)
        except BaseException as e:  # anything unforeseen fails every prefix still mapping, never the engine
            for p in self.prefixes:
                self.failed.setdefault(p.plan.req_id, f"the mapping thread stopped: {type(e).__name__}: {e}")
                self.kinds.setdefault(p.plan.req_id, "worker_error")
        finally:
            for done in self._done:  # no layer waits forever
                done.set()

    def _map_layer(self, li: int):
        for p in self.prefixes:
            rid = p.plan.req_id
            if rid in self.failed:
                continue
            t0 = time.perf_counter()
            try:
                k, v = self.mapper.transfer(p.keys, p.values, p.positions, layers=li, check_finite=False)
                self._out[li].append((p.plan, k[:, 0], v[:, 0]))
            except (ValueError, MapperError, RuntimeError) as e:
                self.failed[rid], self.kinds[rid] = str(e), failure_kind(e)
            self.map_s[rid] = self.map_s.get(rid, 0.0) + time.perf_counter() - t0
        if self._side is not None:
            self._cuda_events[li] = torch.cuda.Event()
            self._cuda_events[li].record(self._side)
        self._done[li].set()

    def wait(self, li: int):
        # Layers before li are passed (skipped where not yet mapped); li itself is taken, so the thread maps it even
        # if it reaches li only now.
        passed, self._passed = self._passed, max(self._passed, li)
        for _ in range(passed, li + 1):  # room for layer li, and for any the forward skipped before it
            self._room.release()
        self._done[li].wait()
        self._passed = max(self._passed, li + 1)
        out, self._out[li] = self._out[li], []
        if self._cuda_events[li] is not None:
            main = torch.cuda.current_stream()
            main.wait_event(self._cuda_events[li])
            for _, k, v in out:  # freed once the caller's stream is done with them
                k.record_stream(main)
                v.record_stream(main)
        return [(plan, k, v) for plan, k, v in out if plan.req_id not in self.failed]

    def join(self):
        """Ends the thread: at once where the forward took every layer; where it skipped some, the layers not yet
        mapped are not (those requests are load errors: their layers were not all written)."""
        self._stop = True
        for _ in range(self.n_layers):
            self._room.release()
        self._thread.join()


# ------------------------------------------------------------------------------------------------ the worker
class WorkerCaches:
    """The engine's attention layers and their paged caches as this worker holds them: which KV heads (placement),
    and how each layer's cache is laid out. What the target and the source parts of a worker share."""

    def __init__(self, ctx: EngineContext, num_blocks: int):
        self.ctx, self.num_blocks = ctx, num_blocks
        self.placement: Optional[HeadPlacement] = None
        self.layers: dict[str, object] = {}  # attention layer name -> layer, in model order
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, PagedLayout] = {}

    def register(self, kv_caches, forward, placement):
        """Takes the engine's caches; `placement(engine_kv_heads, local_kv_heads)` says which heads this worker
        holds. CrossKVConfigError where the engine cannot be served (its start stops, with the key)."""
        from vllm.model_executor.models.utils import extract_layer_index

        ctx = self.ctx
        names = sorted(kv_caches, key=extract_layer_index)
        self.kv_caches = {n: kv_caches[n] for n in names}
        self.layers = {n: forward[n] for n in names}
        first = self.layers[names[0]]
        try:
            self.placement = placement(ctx.engine["n_kv_heads"], int(first.num_kv_heads))
        except ValueError as e:
            raise CrossKVConfigError(f"parallel_config.tensor_parallel_size: {e}") from None
        if len(names) != ctx.engine["n_layers"]:
            raise CrossKVConfigError(f"the engine caches {len(names)} attention layers, its model config says "
                                     f"{ctx.engine['n_layers']}; crosskv maps every layer")
        if not all(hasattr(l.impl, "do_kv_cache_update") for l in self.layers.values()):
            raise CrossKVConfigError("this attention backend has no cache writer (do_kv_cache_update)")
        try:  # the layout (and how the writer quantizes) is learnt now, so an unsupported cache stops the start
            self.layout(names[0])
        except ValueError as e:
            raise CrossKVConfigError(f"cache_config.cache_dtype: {ctx.cache_dtype}: the {type(first.impl).__name__} "
                                     f"cache cannot be read back: {e}") from None
        logger.info("crosskv: worker %s holds KV heads [%d, %d) of %d (replica %d); %s cache", self.placement,
                    self.placement.first, self.placement.first + self.placement.count, self.placement.total,
                    self.placement.replica, ctx.cache_dtype)

    def layout(self, name) -> PagedLayout:
        if name not in self._layouts:
            self._layouts[name] = PagedLayout(self.layers[name], self.kv_caches[name], self.num_blocks,
                                              self.ctx.block_size, self.placement.count, self.ctx.engine["head_dim"],
                                              input_dtype=self.ctx.model_dtype)
        return self._layouts[name]

    @property
    def device(self) -> torch.device:
        return next(iter(self.kv_caches.values())).device


class TargetWorker:
    """A target worker's part: for each planned load, the stored source prefix read, checked, mapped into the KV
    heads this worker holds and written through the attention backend's own cache writer, layer by layer inside the
    forward. A load that fails at any point is a load error (its blocks are recomputed) with the reason."""

    def __init__(self, ctx: EngineContext, caches: WorkerCaches, guard: StoreGuard):
        self.ctx, self.caches, self.guard = ctx, caches, guard
        self.refusal: Optional[Refusal] = ctx.refusal  # why no request can be mapped, where none can
        self._mapper: Optional[Mapper] = None
        self._mapped: list[tuple[LoadPlan, torch.Tensor, torch.Tensor]] = []
        self._by_layer: Optional[LayerByLayer] = None
        self._outcomes: dict[str, Outcome] = {}
        self._failed: set[str] = set()  # this step's loads that failed (no later layer is written)
        self._invalid_blocks: set[int] = set()
        self._written: dict[str, int] = {}  # this step's loads: req_id -> layers written
        self._slots: dict[str, torch.Tensor] = {}  # this step's loads: req_id -> its slots on the cache's device
        self._map_seconds: dict[str, float] = {}  # this step's loads (not layer by layer): req_id -> seconds
        self._applied_seconds: list[float] = []  # since the last stats: each applied load's seconds

    def start(self):
        """Loads the mapper onto the caches' device (or mapper_device); a mapper that cannot be loaded refuses every
        request, and the engine goes on."""
        if self.refusal:
            return
        device = self.ctx.settings.mapper_device or (str(self.caches.device) if self.caches.device.type == "cuda"
                                                     else "cpu")
        try:
            self._mapper = Mapper(self.ctx.settings.mapper, device=device, target_heads=self.caches.placement.heads)
        except MapperError as e:  # a damaged mapper, or a device this package cannot use
            self.refusal = Refusal(f"the mapper cannot be loaded: {e}", "mapper")
            logger.warning("crosskv: every request re-prefills: %s", self.refusal.reason)

    def start_load_kv(self, meta: CrossKVMetadata):
        if not meta.loads:
            return
        try:
            self._start(meta)
        except Exception as e:  # never the engine: every load of the step re-prefills
            logger.exception("crosskv: starting the step's loads failed")
            for plan in meta.loads:
                self._fail(plan, f"starting the load failed: {type(e).__name__}: {e}", "worker_error")

    def _start(self, meta):
        prefixes = []
        for plan in meta.loads:
            try:
                prefixes.append(self._read(plan))
            except (ValueError, MapperError, RuntimeError) as e:
                self._fail(plan, str(e), failure_kind(e))
        prefixes = self._on_device(prefixes)
        if not prefixes:
            return
        layerwise = self.ctx.settings.layerwise
        if layerwise is None:  # on 2 CPU cores the thread only competes with the model's (docs/PERFORMANCE.md)
            layerwise = prefixes[0].keys.device.type == "cuda"
        if layerwise:  # mapped on a thread, layer l while the model computes the layers before it
            self._by_layer = LayerByLayer(self._mapper, prefixes, len(self.caches.layers), prefixes[0].keys.device)
            return
        for p in prefixes:
            t0 = time.perf_counter()
            try:
                k, v = self._mapper.transfer(p.keys, p.values, p.positions, check_finite=False)
                self._mapped.append((p.plan, k, v))
                self._map_seconds[p.plan.req_id] = p.read_s + time.perf_counter() - t0
            except (ValueError, MapperError, RuntimeError) as e:
                self._fail(p.plan, str(e), failure_kind(e))

    def _on_device(self, prefixes: list[SourcePrefix]) -> list[SourcePrefix]:
        """The step's prefixes and their slots on the cache's device (copied from pinned memory without a wait), each
        checked finite once for the step: one host wait per step, not one per layer. A prefix that holds NaN or
        infinity fails its load."""
        dev = self.caches.device
        cuda = dev.type == "cuda"
        up = lambda t: t.pin_memory().to(dev, non_blocking=True) if cuda else t
        on = [replace(p, keys=up(p.keys), values=up(p.values), positions=up(p.positions)) for p in prefixes]
        for p in on:
            self._slots[p.plan.req_id] = up(torch.as_tensor(p.plan.slots, dtype=torch.int64))
        finite = torch.stack([torch.isfinite(p.keys).all() & torch.isfinite(p.values).all() for p in on]).tolist()
        for p, ok in zip(on, finite):
            if not ok:
                self._fail(p.plan, _first_not_finite(p), "not_finite")
        return [p for p, ok in zip(on, finite) if ok]

    def _read(self, plan: LoadPlan) -> SourcePrefix:
        """The plan's stored chunks (every part), checked against its tokens, on the mapper's device. A chunk that
        cannot be used after the first ends the run there: the plan is cut before it, and its blocks on are a load
        error (vLLM recomputes them); a first chunk that cannot be used fails the load."""
        if self._mapper is None:
            raise ValueError(self.refusal.reason if self.refusal else "no mapper on this worker")
        t0 = time.perf_counter()
        deadline = t0 + self.ctx.settings.load_timeout_ms / 1e3
        keys, values, stopped = [], [], None
        for ref in plan.chunks:
            try:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise PrefixError(f"{self.ctx.store.where(ref)}: not read within the load's "
                                      f"{self.ctx.settings.load_timeout_ms} ms", "store_timeout")
                c = self.guard.call("be read", lambda: self.ctx.store.read(ref, plan.salt), left)
                if c.token_ids.tolist() != plan.token_ids[ref.start:ref.end]:
                    raise PrefixError(f"{self.ctx.store.where(ref)}: holds other tokens than its key says", "damaged")
            except PrefixError as e:
                if ref.start <= plan.first:
                    raise
                stopped = str(e)
                logger.warning("crosskv: request %s maps %d tokens, not %d: %s", plan.req_id, ref.start - plan.first,
                               plan.end - plan.first, e)
                self._invalid_blocks.update(s // self.ctx.block_size for s in plan.slots[ref.start - plan.first:])
                plan = replace(plan, end=ref.start, slots=plan.slots[:ref.start - plan.first], stopped=stopped)
                break
            lo, hi = max(plan.first, ref.start) - ref.start, min(plan.end, ref.end) - ref.start
            keys.append(c.keys[lo:hi])
            values.append(c.values[lo:hi])
        used = plan.chunks[:len(keys)]
        self.guard.submit("be marked used", lambda: self.ctx.store.touch(used))  # not waited for
        cat = (lambda xs: xs[0]) if len(keys) == 1 else np.concatenate
        f32 = lambda xs: torch.from_numpy(np.ascontiguousarray(cat(xs), dtype=np.float32))
        pos = torch.arange(plan.first, plan.end, dtype=torch.int32)
        return SourcePrefix(plan, f32(keys), f32(values), pos, time.perf_counter() - t0)

    def _applied(self, plan: LoadPlan, seconds: float):
        self._applied_seconds.append(seconds)
        logger.info("crosskv: worker %d mapped request %s: %d tokens, %.3f ms (%.3f ms per layer)",
                    self.caches.placement.rank, plan.req_id, plan.end - plan.first, seconds * 1e3,
                    seconds * 1e3 / len(self.caches.layers))
        self._outcomes[plan.req_id] = applied(plan.end - plan.first, plan.end, self.ctx.settings.mapper, plan.stopped,
                                              map_ms=round(seconds * 1e3, 3))

    def _fail(self, plan: LoadPlan, reason: str, kind: str):
        logger.warning("crosskv: request %s re-prefills its prefix: %s", plan.req_id, reason)
        self._outcomes[plan.req_id] = fallback(reason, kind)
        self._failed.add(plan.req_id)
        self._invalid_blocks.update(s // self.ctx.block_size for s in plan.slots)

    def wait_for_layer_load(self, layer_name):
        if (not self._mapped and self._by_layer is None) or layer_name not in self.caches.layers:
            return
        layer, cache = self.caches.layers[layer_name], self.caches.kv_caches[layer_name]
        li = list(self.caches.layers).index(layer_name)
        try:
            ready = self._by_layer.wait(li) if self._by_layer is not None else [
                (plan, k[:, li], v[:, li]) for plan, k, v in self._mapped]
        except Exception as e:
            ready = []
            plans = [p.plan for p in self._by_layer.prefixes] if self._by_layer else [p for p, _, _ in self._mapped]
            for plan in plans:
                self._fail(plan, f"layer {li}'s mapped KV could not be taken: {type(e).__name__}: {e}",
                           "worker_error")
        dtype = self.ctx.model_dtype
        for plan, k, v in ready:
            if plan.req_id in self._failed:
                continue
            try:
                self._write(layer, cache, plan, k.to(dtype).contiguous(), v.to(dtype).contiguous())
                self._written[plan.req_id] = self._written.get(plan.req_id, 0) + 1
            except Exception as e:  # this request's blocks are recomputed; the engine goes on
                self._fail(plan, f"writing its mapped KV into layer {li} failed: {type(e).__name__}: {e}",
                           "worker_error")

    def _write(self, layer, cache, plan: LoadPlan, k: torch.Tensor, v: torch.Tensor):
        """A prefix's mapped KV into one layer's paged cache, by the attention backend's own writer (the slots were
        put on the device once for the step)."""
        layer.impl.do_kv_cache_update(layer, k, v, cache, self._slots[plan.req_id])

    def finish_loads(self):
        """The step's loads settled once its forward is done: the layer-by-layer mapping joined, and each load
        applied only where every layer was written (a layer hook the forward skipped, as a full CUDA graph replay
        would, leaves blocks nobody wrote: a load error, recomputed)."""
        by, self._by_layer = self._by_layer, None
        if by is not None:
            by.join()
            loads = [(p.plan, p.read_s + by.map_s.get(p.plan.req_id, 0.0)) for p in by.prefixes]
            for p in by.prefixes:
                if p.plan.req_id in by.failed:
                    self._fail(p.plan, by.failed[p.plan.req_id], by.kinds[p.plan.req_id])
        else:
            loads = [(plan, self._map_seconds.get(plan.req_id, 0.0)) for plan, _, _ in self._mapped]
        n_layers = len(self.caches.layers)
        for plan, seconds in loads:
            if plan.req_id in self._failed:
                continue
            written = self._written.get(plan.req_id, 0)
            if written < n_layers:
                self._fail(plan, f"its mapped KV was written into {written} of {n_layers} layers: the forward skipped "
                                 "the connector's layer hooks (a full CUDA graph?)", "layer_skipped")
            else:
                self._applied(plan, seconds)

    def settle(self):
        """The step's loads settled (finish_loads), and the step's state cleared, whatever happened."""
        try:
            self.finish_loads()
        except Exception as e:  # never the engine: every load of the step re-prefills
            logger.exception("crosskv: settling the step's loads failed")
            for plan, _, _ in self._mapped:
                self._fail(plan, f"settling the load failed: {type(e).__name__}: {e}", "worker_error")
        self._mapped, self._failed, self._written, self._map_seconds, self._slots = [], set(), {}, {}, {}

    def take_outcomes(self) -> dict[str, Outcome]:
        out, self._outcomes = self._outcomes, {}
        return out

    def take_invalid_blocks(self) -> set[int]:
        bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def take_applied_seconds(self) -> list[float]:
        out, self._applied_seconds = self._applied_seconds, []
        return out


class SourceWorker:
    """A source worker's part: each finished request's KV heads that this worker holds, copied out of the paged
    cache and written to the store in the background (one replica of each head range saves; the others release at
    once). Never waits on the store; an unsaved prefix only means a later re-prefill."""

    def __init__(self, ctx: EngineContext, caches: WorkerCaches, guard: StoreGuard):
        self.ctx, self.caches, self.guard = ctx, caches, guard
        self.saver: Optional[Saver] = None
        self._released: set[str] = set()  # saves that need no blocks held (dropped, or another replica's)
        self._held: set[str] = set()  # requests whose blocks vLLM keeps for this worker: each reported once
        self._held_lock = threading.Lock()

    def start(self, world_size: int):
        """Starts the background saver where this worker saves (replica 0 of its heads, on a model crosskv maps)."""
        c, placement = self.caches, self.caches.placement
        if self.ctx.unmappable or placement.replica != 0:
            return
        for name in c.layers:  # every layer's layout now: the saver's thread reads them
            c.layout(name)
        limit = self.ctx.settings.save_queue_bytes or default_save_queue_bytes()
        self.saver = Saver(limit, name=f"crosskv-saver-{placement.rank}")
        atexit.register(self.shutdown)  # an engine that exits without shutting down still drains, bounded
        if placement.count == placement.total and world_size == 1 and self.ctx.engine_id:
            LOCAL_SAVERS[self.ctx.engine_id] = self
        logger.info("crosskv: worker %d saves in the background (%s chunks, queue limit %.1f MiB)",
                    placement.rank, c.layout(next(iter(c.layers))).stored_dtype, limit / 2**20)

    def save(self, plan: SavePlan) -> None:
        """Hands one finished request's save to the background saver (or releases its blocks where this worker does
        not save it); never waits on the store. Called on the step path, or at once by the scheduler side of an
        engine of one worker (local_saver)."""
        with self._held_lock:
            self._held.add(plan.req_id)
        queued = False
        try:
            if self.saver is not None:  # one replica of each head range saves it
                queued = self.saver.submit(self._save_job(plan))
                if not queued:
                    return  # dropped: the saver released it
        except Exception as e:  # an unsaved prefix only means a later re-prefill
            logger.warning("crosskv: request %s: its KV was not saved: %s: %s", plan.req_id, type(e).__name__, e)
        if not queued:
            with self._held_lock:
                self._released.add(plan.req_id)  # every worker reports it, so vLLM frees its blocks

    def _save_job(self, plan: SavePlan) -> SaveJob:
        """The plan's save: its KV read out of the paged cache on the saver's copy thread (on a GPU, on a side
        stream after the step's own work, into pinned host memory), then written on its write thread."""
        slots = torch.as_tensor(plan.slots, dtype=torch.int64)
        caches = list(self.caches.kv_caches.items())
        first = caches[0][1]
        layout0 = self.caches.layout(caches[0][0])
        kv_dtype = layout0.stored_dtype
        ready = None
        if first.is_cuda:  # the copy starts after what the step has queued so far
            ready = torch.cuda.Event()
            ready.record()
        nbytes = 2 * len(plan.slots) * len(caches) * self.caches.placement.count * self.ctx.engine["head_dim"] * (
            1 if kv_dtype in FP8_DTYPES else first.element_size())

        def snapshot():
            return self._copy_out(caches, slots, ready), (
                [layer_scales(self.caches.layers[name]) for name, _ in caches] if kv_dtype in FP8_DTYPES else None)

        def write(kv, scales):
            (k, v) = kv
            e = self.ctx.engine
            meta = {"source_model": self.ctx.model_name, "n_layers": e["n_layers"], "n_kv_heads": e["n_kv_heads"],
                    "head_dim": e["head_dim"], "rope_type": e["rope"]["type"], "rope_theta": e["rope"]["theta"],
                    "rope": e["rope"], "tokenizer": self.ctx.tokenizer, "cache_dtype": self.ctx.cache_dtype,
                    "source_weights": self.ctx.weights or "",
                    "kv_dtype": kv_dtype}
            if scales is not None:
                meta.update(k_scales=[s[0] for s in scales], v_scales=[s[1] for s in scales])
            written, shared = self.guard.call("be written", lambda: self.ctx.store.save(
                plan.token_ids, self.caches.placement.first, self.caches.placement.count, meta, lambda a, b: (k[a:b], v[a:b]),
                plan.salt), None)
            logger.info("crosskv: saved request %s's %d tokens, KV heads [%d, %d), %s: %d chunks written, %d already "
                        "stored", plan.req_id, len(plan.token_ids), self.caches.placement.first,
                        self.caches.placement.first + self.caches.placement.count, kv_dtype, written, shared)
            return written, shared

        return SaveJob(plan.req_id, nbytes, snapshot, write)

    def _copy_out(self, caches, slots: torch.Tensor, ready) -> tuple[np.ndarray, np.ndarray]:
        """K and V [tokens, layers, heads, dim] of the given slots, as the caches hold them, in host memory: gathered
        one layer at a time, in pieces of at most SAVE_COPY_BYTES, each copied out before the next (on a GPU: on a
        side stream after `ready`, into pinned memory), so a save holds a piece of one layer on the device, never the
        request."""
        first = caches[0][1]
        side = torch.cuda.Stream(device=first.device) if ready is not None else None
        raw = torch.uint8 if self.caches.layout(caches[0][0]).format is not None else first.dtype
        per_token = self.caches.placement.count * self.ctx.engine["head_dim"] * torch.tensor([], dtype=raw).element_size()
        piece = max(1, SAVE_COPY_BYTES // per_token)
        shape = (len(caches), len(slots), self.caches.placement.count, self.ctx.engine["head_dim"])
        hk = torch.empty(shape, dtype=raw, pin_memory=side is not None)
        hv = torch.empty(shape, dtype=raw, pin_memory=side is not None)
        with (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()):
            if side is not None:
                side.wait_event(ready)
            dev_slots = slots.to(first.device, non_blocking=side is not None)
            for li, (name, cache) in enumerate(caches):
                layout = self.caches.layout(name)
                for a in range(0, len(slots), piece):
                    k, v = layout.read_raw(cache, dev_slots[a:a + piece])
                    hk[li, a:a + piece].copy_(k, non_blocking=side is not None)
                    hv[li, a:a + piece].copy_(v, non_blocking=side is not None)
            if side is not None:
                side.synchronize()
        return _host_bits(hk.transpose(0, 1)), _host_bits(hv.transpose(0, 1))

    def shutdown(self):
        """Drains the saver for at most save_drain_seconds, then abandons what is left (one log line)."""
        if LOCAL_SAVERS.get(self.ctx.engine_id) is self:
            del LOCAL_SAVERS[self.ctx.engine_id]
        if self.saver is not None:
            self.saver.close(self.ctx.settings.save_drain_seconds)

    def get_finished(self):
        """The requests whose blocks this worker no longer needs, each reported exactly once (vLLM frees a request's
        blocks when every worker has reported it, and asserts on a second report)."""
        with self._held_lock:
            done, self._released = self._released, set()
            if self.saver is not None:
                done |= self.saver.take_released()
            extra = done - self._held
            done &= self._held
            self._held -= done
        if extra:
            logger.warning("crosskv: the saver released requests %s that this worker does not hold (twice, or "
                           "never held); not reported again", sorted(extra))
        return done or None

    def record_stats(self, stats: CrossKVStats):
        if self.saver is not None:
            counts, seconds = self.saver.take_counts()
            stats.record_saves(counts, seconds, self.saver.queued_bytes)


class Worker:
    """The connector's worker, one per tensor-parallel worker: the caches it holds, a TargetWorker where its engine's
    role maps and a SourceWorker where it saves (both for kv_both), one store guard and one set of stats for them.
    Nothing on this path takes the engine down: any failure makes that request's blocks a load error, recomputed,
    with the reason."""

    # the parts it runs (a test's connector plants its faults in a subclass)
    target_worker = TargetWorker
    source_worker = SourceWorker

    def __init__(self, ctx: EngineContext, vllm_config, kv_cache_config):
        self.ctx, self._vllm_config = ctx, vllm_config
        st = ctx.settings
        self.guard = StoreGuard(ctx.store.spec, st.breaker_failures, st.breaker_seconds)
        self._guard_opened = 0
        self._stats = CrossKVStats()
        self.caches = WorkerCaches(ctx, kv_cache_config.num_blocks if kv_cache_config is not None else 0)
        self.target = self.target_worker(ctx, self.caches, self.guard) if ctx.role.maps else None
        self.source = self.source_worker(ctx, self.caches, self.guard) if ctx.role.saves else None

    def register_kv_caches(self, kv_caches):
        if self.ctx.unmappable:  # a hybrid or sliding-window model: nothing to set up
            return
        forward = self._vllm_config.compilation_config.static_forward_context
        self.caches.register(kv_caches, forward, self._placement)
        if self.source is not None:
            self.source.start(self._world_size())
        if self.target is not None:
            self.target.start()

    @staticmethod
    def _world_size() -> int:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()

    def _placement(self, engine_kv_heads: int, local_kv_heads: int):
        """This worker's KV heads of the engine's (tests plant a wrong placement by overriding it)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return head_placement(engine_kv_heads, local_kv_heads, get_tensor_model_parallel_rank(),
                              get_tensor_model_parallel_world_size())

    def start_load_kv(self, forward_context, meta):
        if self.target is not None and isinstance(meta, CrossKVMetadata):
            self.target.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name):
        if self.target is not None:
            self.target.wait_for_layer_load(layer_name)

    def wait_for_save(self, meta):
        """Settles the step's loads, then hands each finished request's save to the background saver; never waits
        on the store."""
        if self.target is not None:
            self.target.settle()
        if self.source is not None and isinstance(meta, CrossKVMetadata):
            for plan in meta.saves:
                self.source.save(plan)

    def get_finished(self, finished_req_ids):
        return (self.source.get_finished() if self.source is not None else None), None

    def get_block_ids_with_load_errors(self):
        return self.target.take_invalid_blocks() if self.target is not None else set()

    def build_connector_worker_meta(self):
        outcomes = self.target.take_outcomes() if self.target is not None else {}
        return CrossKVWorkerMetadata(outcomes) if outcomes else None

    def get_kv_connector_stats(self):
        if self.target is not None:
            for seconds in self.target.take_applied_seconds():
                self._stats.record_map(seconds)
        if self.source is not None:
            self.source.record_stats(self._stats)
        return take_stats(self)

    def shutdown(self):
        if self.source is not None:
            self.source.shutdown()
        self.guard.close()


def _first_not_finite(p: SourcePrefix) -> str:
    """Where a stored source prefix first holds NaN or infinity (token, layer, head, dim), by name."""
    for name, x in (("keys", p.keys), ("values", p.values)):
        bad = torch.nonzero(~torch.isfinite(x))
        if len(bad):
            at = bad[0].tolist()
            what = "NaN" if bool(torch.isnan(x[tuple(at)])) else "infinity"
            return (f"the stored source {name} at token {p.plan.first + at[0]}, layer {at[1]}, head {at[2]}, dim "
                    f"{at[3]} is {what}; a source cache must be finite")
    return "the stored source KV is not finite"


def default_save_queue_bytes() -> int:
    """The save queue's default limit: 1/16 of the host's memory, for each saving worker."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 16
    except (ValueError, OSError):
        return 1 << 30


def _host_bits(t: torch.Tensor) -> np.ndarray:
    """A host tensor's elements as the numpy array the store keeps: bfloat16 as its uint16 bits, fp8 as bytes."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()
