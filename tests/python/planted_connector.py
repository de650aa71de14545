"""Planted bugs for the vLLM tests, as connectors the tests load by module path (spec key "planted"), so that no
test fault lives in crosskv's own code. Each subclasses CrossKVConnector and swaps its worker side.

    rank0_heads   every tensor-parallel worker maps worker 0's heads (labelled applied: the TP check must catch it)
    write_once    the first write of mapped KV into the paged cache, in each worker, raises
"""
from dataclasses import replace

from crosskv.vllm.connector import CrossKVConnector
from crosskv.vllm.worker import WorkerSide


class _Rank0Heads(WorkerSide):
    def _placement(self, engine_kv_heads, local_kv_heads):
        p = super()._placement(engine_kv_heads, local_kv_heads)
        return replace(p, first=0) if self.ctx.side == "target" else p


class _WriteOnce(WorkerSide):
    _raised = False

    def _write(self, layer, cache, plan, k, v):
        if not _WriteOnce._raised:
            _WriteOnce._raised = True
            raise RuntimeError("a planted fault in the cache write")
        super()._write(layer, cache, plan, k, v)


class Rank0HeadsConnector(CrossKVConnector):
    worker_side = _Rank0Heads


class WriteOnceConnector(CrossKVConnector):
    worker_side = _WriteOnce


CONNECTORS = {"rank0_heads": "Rank0HeadsConnector", "write_once": "WriteOnceConnector"}
