"""flashmem's own SDPA calls (cache/sdpa.py): cuDNN left out on CUDA, where it plans each new
length anew (60 ms a call on an H200); PyTorch's choice elsewhere; the same attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from flashmem.cache import sdpa


def test_cuda_leaves_cudnn_out_and_the_cpu_is_left_alone():
    allowed = sdpa.backends_for(torch.device("cuda", 0))
    assert allowed is not None and SDPBackend.CUDNN_ATTENTION not in allowed and SDPBackend.MATH in allowed
    assert sdpa.backends_for(torch.device("cpu")) is None


def test_the_attention_is_sdpas():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(1, 4, 3, 5).masked_fill_(torch.rand(1, 4, 3, 5, generator=g) > 0.7, float("-inf"))
    mask[..., 0] = 0.0
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.equal(sdpa.attention(q, k, v, mask, 0.3, True), want)
