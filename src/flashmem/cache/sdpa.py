"""The SDPA call of flashmem's own attentions, with the backends a decode step can afford.

PyTorch 2.11 on an H200 runs a masked bf16 SDPA with cuDNN's attention, and cuDNN builds an
execution plan for every new shape: a decode-shaped call (1 query x 32 heads over 8 KV heads
x 8,192 keys, a float mask) took 60.6 ms at a length it had not seen and 0.12 ms at one it had
(results/gpu_step_anatomy_h200_nocudnn.json, `sdpa_backends`). A step attends one more key
than the last, so each is a new shape: 34-37 ms of a 4-layer step went to planning
(results/gpu_step_anatomy_h200.json). On CUDA flashmem's calls leave cuDNN out; with a float
mask and GQA that is the math kernel, 0.48 ms a call at 8,192 keys in the same run.

`sdpa_kernel` sets PyTorch's process-wide backend flags for the call's duration: another
thread's SDPA call meanwhile sees them too (the same attention, by another kernel).

Shapes as F.scaled_dot_product_attention: q [b, Hq, m, d]; k, v [b, Hkv, L, d]; mask
broadcastable to [b, Hq, m, L].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# every backend but cuDNN's, in PyTorch's order of preference
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def backends_for(device: torch.device) -> list[SDPBackend] | None:
    """The SDPA backends flashmem allows on `device` (None: PyTorch's choice, unrestricted)."""
    return NO_CUDNN if device.type == "cuda" else None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    under `backends_for(q.device)` -> [b, Hq, m, d]."""
    allowed = backends_for(q.device)
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    with sdpa_kernel(allowed):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
