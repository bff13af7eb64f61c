"""The sealed pages coded as an int8 working set holds them, in host memory, for the static step.

`decode_step: static` reads a fixed number of pages a step across the link
(`cache/static_step.py`). With `working_set_codec: int8`, reading them already coded carries
1 + 4/d bytes an element instead of the model's 2 (bf16) or 4 (fp32), and the device no longer
codes them. A page's codes depend on its own tokens only (`compress/page_code.py`), so coding
each block once on the host gives the codes the device would make at every read.

Filled from the cold tier's exact arena (`MemoryStore.block_run`) when a segment starts, with
the blocks sealed since; pinned where a GPU is present, so the device can gather from it
(`store/mapped.py`). A row change drops it (`cache/generation.py`); the next segment codes
every block again. Counted in `memory_report()["page_code_host_bytes"]`.

Shapes: codes [slots, 2 (K, V), b, h, B, d] int8; scales [slots, 2, b, h, B] fp32 (one per
token and KV head). As page rows: [slots * 2 * b * h * B / P, P * d] and [.., P].
"""

from __future__ import annotations

import torch

from flashmem.compress import page_code
from flashmem.store.transfer import pinning


class PageCodes:
    def __init__(self) -> None:
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.blocks = 0  # blocks coded so far (0 .. blocks - 1)

    def sync(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Code the blocks of the exact arena's run k, v [n, b, h, B, d] (blocks 0 .. n - 1,
        host memory) not coded yet; the capacity grows by a quarter (at least 64 blocks)."""
        n = k.shape[0]
        if self.codes is not None and tuple(self.codes.shape[2:5]) != tuple(k.shape[1:4]):
            self.codes = self.scales = None  # other rows or block sizes: coded again
            self.blocks = 0
        if n <= self.blocks:
            return
        cap = 0 if self.codes is None else self.codes.shape[0]
        if n > cap:
            grown = max(n, cap + max(64, cap // 4))
            codes = torch.empty((grown, 2, *k.shape[1:]), dtype=torch.int8, pin_memory=pinning())
            scales = torch.empty((grown, 2, *k.shape[1:4]), dtype=torch.float32, pin_memory=pinning())
            if self.codes is not None and self.scales is not None and self.blocks:
                codes[: self.blocks] = self.codes[: self.blocks]
                scales[: self.blocks] = self.scales[: self.blocks]
            self.codes, self.scales = codes, scales
        assert self.codes is not None and self.scales is not None
        j = self.blocks
        for i, part in enumerate((k, v)):
            c, s = page_code.encode(part[j:n])  # [m, b, h, B, d] int8, [m, b, h, B, 1] fp32
            self.codes[j:n, i] = c
            self.scales[j:n, i] = s[..., 0]
        self.blocks = n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales) if t is not None)
