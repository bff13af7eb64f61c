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

On a CPU without AMX for the dtype, a bf16 or fp16 SDPA with one query per head runs 6-8x
slower than fp32 (PyTorch 2.13, one thread of an AVX512-BF16 AMD EPYC, 9 query heads over 3
KV heads: 0.96 against 0.13 ms at 1,024 keys, 7.9 against 1.0 ms at 8,192; from 16 queries up
the two are even; benchmarks/diagnostics/half_sdpa.py). A decode step's call there is
computed in fp32 instead (`_one_query_fp32`: two matmuls and a softmax, the result cast back),
as accurate as the half SDPA or more. Its transient is an fp32 copy of the call's K and V (twice
their half bytes), freed when it returns. With AMX for the dtype (an Intel Xeon with AMX-BF16,
bf16) PyTorch's own call is the faster: 0.15 and 1.25 ms there against the fp32 detour's 0.41
and 2.77 (the same script, results/half_sdpa_xeon_bf16.json), so it stays; that CPU has no
AMX-FP16, and its fp16 call is the slower (3.30 against 1.88 ms at 8,192 keys,
results/half_sdpa_xeon_fp16.json). On an accelerator nothing changes.

With GQA, PyTorch's CPU fp32 call reads a KV head once per query head. One query per head is
the common decode call, and there each KV head's group of query heads is passed as that head's
queries instead (`_one_query_grouped`: the same attention, each KV head read once), from
GROUPED_MIN_KEYS keys over the call's rows. On the Xeon of stop 51, 9 query heads over 3 KV heads
(SmolLM2), one row: 0.78x the time at 1,100 keys, 0.59x at 4,000 (1.17x at 100: below the floor);
8 rows: 0.81x at 100 keys, 0.59x at 1,100, 0.55x at 4,000 (`python
benchmarks/diagnostics/half_sdpa.py --grouped --keys 100,1100,4000 --reps 100`,
results/grouped_sdpa_xeon.json). In bf16 with AMX the grouped call is mostly the slower
(0.97-2.27x), so half dtypes keep their paths above.

Shapes as F.scaled_dot_product_attention: q [b, Hq, m, d]; k, v [b, Hkv, L, d]; mask
broadcastable to [b, Hq, m, L].
"""

from __future__ import annotations

import functools

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
    if q.device.type == "cpu" and q.dtype in HALF and q.shape[2] == 1 and half_sdpa_is_slow(q.dtype):
        return _one_query_fp32(q, k, v, mask, scale)
    if q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[2] == 1 and gqa:
        if k.shape[0] * k.shape[2] >= GROUPED_MIN_KEYS:
            return _one_query_grouped(q, k, v, mask, scale)
    allowed = backends_for(q.device)
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    with sdpa_kernel(allowed):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


# PyTorch's fused flash attention on a CPU, which also returns each query's log-sum-exp
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, h, r, d] over k, v [b, h, n, d] with an additive bias [b, h, n] on
    each key (every row of a head alike), and its log-sum-exp: -> (out [b, h, r, d] fp32, lse
    [b, h, r] fp32; a head that sees none of the keys: out 0, lse -inf, so it weighs nothing
    when parts are merged). By the fused flash kernel on a CPU in fp32, else by the scores."""
    if FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == k.dtype == torch.float32:
        out, lse = FLASH_CPU(q, k, v, 0.0, False, attn_mask=bias[:, :, None, :], scale=scale)
        # the kernel gives a head that sees no key lse 0, which would be a mass of 1
        return out, lse.masked_fill_((bias.amax(-1) == float("-inf"))[..., None], float("-inf"))
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale).add_(bias.float()[:, :, None, :])
    lse = torch.logsumexp(s, dim=-1)  # [b, h, r]: -inf where every key is hidden
    p = s.sub_(lse.masked_fill(lse == float("-inf"), 0.0)[..., None]).exp_()  # such rows: all 0
    return torch.matmul(p, v.float()), lse


HALF = (torch.bfloat16, torch.float16)
# Keys (rows x length) from which the grouped one-query call is the faster: below, its reshapes
# cost what it saves (one row of 100 keys: 1.17x the time; 8 rows of 100: 0.81x)
GROUPED_MIN_KEYS = 512
# PyTorch's probes of this CPU's AMX support for each half dtype (AMX-BF16 comes with the tiles)
AMX_PROBES = {torch.bfloat16: "_is_amx_tile_supported", torch.float16: "_is_amx_fp16_supported"}


@functools.cache
def half_sdpa_is_slow(dtype: torch.dtype) -> bool:
    """Whether this CPU's one-query SDPA in `dtype` takes the slow path: no AMX for it (or
    no probe to ask, as in a PyTorch without one)."""
    probe = getattr(torch.cpu, AMX_PROBES[dtype], None)
    try:
        return not (probe is not None and bool(probe()))
    except Exception:  # noqa: BLE001 - a private probe that fails says nothing: take the safe path
        return True


def _one_query_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """`attention` for one query per head with GQA, each KV head's group of query heads as
    its queries: q [b, Hq, 1, d] -> [b, Hkv, group, d] over k, v [b, Hkv, L, d] (query head
    j * group + g reads KV head j, as enable_gqa pairs them), mask broadcastable to
    [b, Hq, 1, L] -> [b, Hq, 1, d]. The same attention as enable_gqa's, read once per KV head."""
    b, hq, _, d = q.shape
    hkv, L = k.shape[1], k.shape[2]
    group = hq // hkv
    if mask is not None:
        full = mask.shape == (b, hq, 1, L)
        mask = (mask if full else torch.broadcast_to(mask, (b, hq, 1, L))).reshape(b, hkv, group, L)
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, group, d), k, v, attn_mask=mask, scale=scale)
    return out.view(b, hq, 1, d)


def _one_query_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """`attention` for one query per head in fp32, cast back to q's dtype: q [b, Hq, 1, d], k, v
    [b, Hkv, L, d] (query head j * group + g reads KV head j, as enable_gqa pairs them), mask
    bool (True: attend) or additive, broadcastable to [b, Hq, 1, L] -> [b, Hq, 1, d]."""
    b, hq, m, d = q.shape
    hkv, L = k.shape[1], k.shape[2]
    group = hq // hkv
    logits = torch.matmul(q.float().reshape(b, hkv, group * m, d), k.float().transpose(-1, -2))  # [b, h, g, L]
    logits.mul_(d**-0.5 if scale is None else scale)
    if mask is not None:
        mask = torch.broadcast_to(mask, (b, hq, m, L)).reshape(b, hkv, group * m, L)
        if mask.dtype == torch.bool:
            logits.masked_fill_(~mask, float("-inf"))
        else:
            logits.add_(mask)
    out = torch.matmul(torch.softmax(logits, dim=-1), v.float())  # [b, h, g, d]
    return out.view(b, hq, m, d).to(q.dtype)
