"""flashmem's prefix tier inside vLLM: a v1 KV connector (docs/vllm.md).

    from vllm import LLM
    from flashmem.integrations.vllm import kv_transfer_config

    llm = LLM(model=..., kv_transfer_config=kv_transfer_config(store="disk", path="/var/lib/flashmem/vllm"))

Importing this package does not import vLLM; `connector` does, when vLLM loads it.
"""

from __future__ import annotations

from typing import Any

CONNECTOR = "FlashmemConnector"
MODULE = "flashmem.integrations.vllm.connector"


def kv_transfer_config(**extra: Any) -> dict[str, Any]:
    """The `kv_transfer_config` dict that selects the connector; `extra` becomes its
    `kv_connector_extra_config` (store, path, quota_bytes, chunk_tokens, salt, verify,
    ttl_s, model_id; see `plan.Options.parse`). Failed loads are recomputed."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


__all__ = ["CONNECTOR", "MODULE", "kv_transfer_config"]
