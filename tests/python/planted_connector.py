"""Planted bugs for the vLLM tests, as connectors the tests load by module path (spec key "planted"), so that no
test fault lives in crosskv's own code. Each subclasses CrossKVConnector and swaps its scheduler side, its worker, or a worker's target part.

    rank0_heads     every tensor-parallel worker maps worker 0's heads (labelled applied: the TP check must catch it)
    write_once      the first write of mapped KV into the paged cache, in each worker, raises
    no_reload       a request resumed after preemption is promised its mapped prefix, but no load is planned (the
                    behaviour before: it attends over blocks nobody wrote)
    next_step_save  a finished request's save waits for the engine's next step (the behaviour before: an engine that
                    idles after its last batch saves nothing)
    any_weights     chunks are not checked against the mapper's source weights (another model's KV is mapped)
    no_piecewise    does not ask vLLM for piecewise CUDA graphs (a full graph's replay skips its layer hooks)
    save_allocated  a finished request saves every slot of the blocks it was given, not only the tokens computed (an
                    aborted request's last block holds slots nobody wrote)
"""
from dataclasses import replace

from crosskv.vllm.connector import CrossKVConnector
from crosskv.vllm.metadata import fallback
from crosskv.vllm.scheduler import SchedulerSide
from crosskv.vllm.config import Role
from crosskv.vllm.worker import TargetWorker, Worker


class _Rank0Heads(Worker):
    def _placement(self, engine_kv_heads, local_kv_heads):
        p = super()._placement(engine_kv_heads, local_kv_heads)
        return replace(p, first=0) if self.ctx.role == Role.TARGET else p


class _WriteOnceTarget(TargetWorker):
    _raised = False

    def _write(self, layer, cache, plan, k, v):
        if not _WriteOnceTarget._raised:
            _WriteOnceTarget._raised = True
            raise RuntimeError("a planted fault in the cache write")
        super()._write(layer, cache, plan, k, v)


class _WriteOnce(Worker):
    target_worker = _WriteOnceTarget


class _NoReload(SchedulerSide):
    def build_connector_meta(self, scheduler_output):
        for rid in set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ())) & set(self._to_load):
            del self._to_load[rid]
            self._outcomes[rid] = fallback("preempted before its prefix was loaded", "preempted")
        return super().build_connector_meta(scheduler_output)


class _NextStepSave(SchedulerSide):
    def _local_saver(self):
        return None


class _AnyWeights(SchedulerSide):
    def __init__(self, ctx):
        super().__init__(ctx)
        ctx.manifest = {**ctx.manifest, "source_weights": None}


class _SaveAllocated(SchedulerSide):
    def _plan_save(self, request, block_ids):
        computed = request.num_computed_tokens
        request.num_computed_tokens = min(len(block_ids) * self.ctx.block_size, len(request.all_token_ids))
        try:
            return super()._plan_save(request, block_ids)
        finally:
            request.num_computed_tokens = computed


class Rank0HeadsConnector(CrossKVConnector):
    worker_side = _Rank0Heads


class WriteOnceConnector(CrossKVConnector):
    worker_side = _WriteOnce


class NoReloadConnector(CrossKVConnector):
    scheduler_side = _NoReload


class NextStepSaveConnector(CrossKVConnector):
    scheduler_side = _NextStepSave


class AnyWeightsConnector(CrossKVConnector):
    scheduler_side = _AnyWeights


class NoPiecewiseConnector(CrossKVConnector):
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        return False


class SaveAllocatedConnector(CrossKVConnector):
    scheduler_side = _SaveAllocated


CONNECTORS = {"rank0_heads": "Rank0HeadsConnector", "write_once": "WriteOnceConnector",
              "no_reload": "NoReloadConnector", "next_step_save": "NextStepSaveConnector",
              "any_weights": "AnyWeightsConnector", "save_allocated": "SaveAllocatedConnector",
              "no_piecewise": "NoPiecewiseConnector"}
