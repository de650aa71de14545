"""CrossKVConnector: the class vLLM loads (kv_connector_module_path crosskv.vllm). It holds no state of its own: the
scheduler's calls go to a SchedulerSide, the workers' to a Worker (with a target part where the engine's role maps
and a source part where it saves), as vLLM's own connectors are cut. It implements
KVConnectorBase_V1 of vLLM 0.32 and 0.33 (tests/python/test_vllm_units.py checks every abstract method and signature
against the installed vLLM)."""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from .context import engine_context
from .metrics import CrossKVPromMetrics, CrossKVStats
from .scheduler import SchedulerSide
from .worker import Worker


class CrossKVConnector(KVConnectorBase_V1):
    """kv_producer: the source model's engine, saving finished requests' KV. kv_consumer: the target's, mapping
    stored prefixes into its cache."""

    # what the scheduler and each worker run (a test's connector plants its faults in a subclass)
    scheduler_side = SchedulerSide
    worker_side = Worker

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ctx = engine_context(vllm_config, kv_cache_config)
        self._scheduler = self.scheduler_side(ctx) if role == KVConnectorRole.SCHEDULER else None
        self._worker = self.worker_side(ctx, vllm_config, kv_cache_config) if role == KVConnectorRole.WORKER else None

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    # worker side
    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        self._worker.start_load_kv(forward_context, self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        self._worker.wait_for_save(self._get_connector_metadata() if self.has_connector_metadata() else None)

    def get_finished(self, finished_req_ids):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.build_connector_worker_meta()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.guard.close()

    # vLLM's declarations
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        """True on a target (its config names a mapper): mapped KV is written inside the forward, in
        wait_for_layer_load, layer by layer or not, so that hook must run between the graph's pieces and vLLM keeps
        full CUDA graphs off (its log says "requires PIECEWISE CUDA graph mode ... Overriding cudagraph_mode ... to
        PIECEWISE"). A source writes nothing in the forward. A load whose layer hook was skipped anyway is a load
        error, never applied (TargetWorker.finish_loads)."""
        return bool((extra_config or {}).get("mapper"))

    @property
    def requires_kv_delivery(self) -> bool:
        """vLLM 0.33: a best-effort cache. A save that is dropped or lost is a later re-prefill, never wrong KV."""
        return False

    # both: the metrics
    def get_kv_connector_stats(self):
        side = self._scheduler or self._worker
        return side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return CrossKVStats(data=data) if data is not None else CrossKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return CrossKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
