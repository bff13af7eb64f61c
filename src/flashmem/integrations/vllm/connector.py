"""`FlashmemConnector`: vLLM's v1 KV connector over flashmem's prefix stores.

Select it with

    --kv-transfer-config '{"kv_connector": "FlashmemConnector",
        "kv_connector_module_path": "flashmem.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "disk", "path": "/var/lib/flashmem/vllm"}}'

(or the same dict as `LLM(kv_transfer_config=...)`; `flashmem.integrations.vllm.
kv_transfer_config` builds it). The logic lives in `plan.py` (it runs without
vLLM); this module only adapts vLLM's objects to it. Importing this module
imports vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import FullAttentionSpec

from flashmem.errors import FlashMemError
from flashmem.integrations.vllm.plan import Options, Planner, StepPlan, Worker, fingerprint, request_salt
from flashmem.integrations.vllm.stores import open_backend

try:  # where an external hit came from, in vLLM's metrics (newer vLLM)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _DISK: Any = CacheHitSource.DISK
except ImportError:  # pragma: no cover - older vLLM
    _DISK = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class FlashmemConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's plan, sent to the workers."""

    plan: StepPlan = field(default_factory=StepPlan)


class FlashmemConnector(KVConnectorBase_V1):
    """Saves vLLM's prompt KV blocks as checked, tenant-salted flashmem prefix records and
    loads them into a later request's blocks, in this engine or another one."""

    if _DISK is not None:
        _cache_hit_source = _DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
            raise FlashMemError(
                "flashmem vLLM connector: tensor/pipeline parallel size "
                f"{par.tensor_parallel_size}/{par.pipeline_parallel_size}; allowed: 1/1 (records hold one worker's KV)"
            )
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
            raise FlashMemError(
                f"flashmem vLLM connector: KV cache groups [{kinds}]; allowed: one FullAttentionSpec group "
                "(models with sliding-window, hybrid or MLA layers are not supported yet)"
            )
        spec = groups[0].kv_cache_spec
        self.block_size = int(vllm_config.cache_config.block_size)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        model_id = extra.pop("model_id", None)
        self.opts = Options.parse(extra, self.block_size)
        mc = vllm_config.model_config
        layout = {
            "block_size": self.block_size,
            "spec": type(spec).__name__,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "head_size_v": getattr(spec, "head_size_v", None),
            "dtype": str(spec.dtype),
            "cache_dtype": str(vllm_config.cache_config.cache_dtype),
            "model_dtype": str(mc.dtype),
            "quantization": str(getattr(mc, "quantization", None)),
            "layers": ",".join(sorted(groups[0].layer_names)),
            # the paged buffer's physical layout differs between platforms and attention backends
            "platform": str(getattr(current_platform, "device_type", "")),
            "attn_backend": str(getattr(getattr(vllm_config, "attention_config", None), "backend", None)),
            "chunk_tokens": self.opts.chunk_tokens,
        }
        self.model_id = str(model_id or f"{mc.model}@{getattr(mc, 'revision', None)}")
        self.fp = fingerprint(self.model_id, layout)
        self.store = open_backend(self.opts.store, self.opts.path, self.opts.quota_bytes, ttl_s=self.opts.ttl_s)
        self.planner: Planner | None = None
        self.worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.planner = Planner(self.store, self.opts, self.block_size, self.fp)
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
                log.warning(
                    "flashmem vLLM connector: kv_load_failure_policy is not 'recompute': a record that is evicted or "
                    "damaged between the lookup and the load fails its request instead of being recomputed"
                )
        else:
            self.worker = Worker(self.store, self.opts, self.block_size, int(kv_cache_config.num_blocks))
        log.info(
            "flashmem vLLM connector (%s): store %s %s, chunk %d tokens, quota %s",
            role.name,
            self.opts.store.split("@")[-1],
            self.opts.path or "",
            self.opts.chunk_tokens,
            self.opts.quota_bytes,
        )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between layers: a full CUDA graph would skip it

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost answer

    # ==================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FlashmemConnectorMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        plan = self._plan()
        if not plan.loads:
            return
        if not self.worker.kv:  # a runner that did not register its caches: take them from the layers
            layers = getattr(forward_context, "no_compile_layers", {}) or {}
            self.worker.register(
                {
                    n: layer.kv_cache
                    for n, layer in layers.items()
                    if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
                }
            )
        self.worker.load(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        plan = self._plan()
        if plan.saves:
            self.worker.stage(layer_name, kv_layer, plan.saves)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if self.has_connector_metadata():
            plan = self._plan()
            if plan.saves:
                self.worker.flush(plan.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        part = self.worker or self.planner
        if part is not None:
            counters = dict(part.counters)
            counters["damaged"] = getattr(self.store, "damaged", 0)
            counters["evictions"] = getattr(self.store, "evictions", 0)
            counters["unreachable"] = getattr(self.store, "unreachable", 0)
            log.info("flashmem vLLM connector (%s): %s", self.role.name, counters)
        close = getattr(self.store, "close", None)
        if close is not None:
            close()

    # ==================================================================== scheduler side
    def _salt(self, request: Request) -> str:
        lora = getattr(request, "lora_request", None)
        mm = [str(getattr(f, "identifier", "")) for f in (getattr(request, "mm_features", None) or [])]
        return request_salt(self.opts.salt, getattr(request, "cache_salt", None), getattr(lora, "lora_name", None), mm)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.planner is not None
        n = self.planner.lookup(request.request_id, request.prompt_token_ids, self._salt(request), num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.planner is not None
        self.planner.allocated(request.request_id, request.prompt_token_ids, self._salt(request), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.planner is not None
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        resumed = getattr(c, "resumed_req_ids", set()) or set()
        cached = [
            (rid, ids[0] if ids is not None else None, rid in resumed, computed)
            for rid, ids, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens)
        ]
        plan = self.planner.build(
            new, cached, scheduler_output.num_scheduled_tokens, getattr(scheduler_output, "finished_req_ids", ())
        )
        return FlashmemConnectorMetadata(plan)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.planner is not None
        self.planner.finished(request.request_id)
        return False, None
