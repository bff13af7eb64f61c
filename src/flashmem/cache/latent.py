"""The cold tier's low-rank layout (`cold_low_rank`): the seed's MLA step, post hoc.

A sealed block's keys and/or values go to the cold tier as `low_rank_dim` (r)
coefficients per token and KV head on bases `flashmem calibrate` fitted
(`calibration/fit.py`, `fit_cold_bases`): keys are un-rotated to their pre-RoPE
form at their true positions and coded on the pre-RoPE key basis (`cold_key_basis`:
`attention`, the rank-r code E [r, d] / decoder D [r, d] with the least expected
q.k error over the calibration's queries, or `pca`, the keys' principal directions
U, E = D = U); values are projected on their PCA basis U_v [r, d]. A read
reconstructs D^T c and,
for keys, rotates them again at the tokens' positions, so everything above the
read path (selection, re-ranking, attention) sees ordinary [.., d] keys and
values. The store keeps plain tensors and stays agnostic: any store and codec
(int8/int4 of the coefficients included) composes.

Stores take a block as two tensors of one shape (`check_pair`). When only one of
K/V is low-rank the two widths differ (r and d), so a token's row is packed:
cat(key part, value part) is cut in two halves of (r_k + r_v) / 2 columns each
(one zero column when the sum is odd); the store's "k" slot holds the first
half, its "v" slot the second. With `kv` that is exactly (keys, values). Keys
come first, so the key coefficients lie in the k slot whenever r_k <= r_v and a
keys-only read (re-rank candidates) touches one slot; otherwise both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from flashmem.errors import ConfigError
from flashmem.rope import RopeRotator
from flashmem.sizing.calculator import cold_elements_per_token

if TYPE_CHECKING:
    from flashmem.config import FlashMemoryConfig

Mode = Literal["keys", "values", "kv"]


class LatentKV:
    """Codes a layer's sealed K/V into calibrated low-rank coefficients and back.

    key_basis / value_basis: [Hkv, >= rank, d] rows descending (the calibration's
    full-rank bases; the first `rank` rows are used), None for a part kept exact:
    coefficients are basis @ x. key_decoder: the same shape, k_pre = decoder^T c
    (default: key_basis, an orthonormal basis; another matrix for the
    attention-weighted code). rotator: the layer's RoPE (required when keys are low-rank).
    """

    def __init__(
        self,
        mode: Mode,
        rank: int,
        head_dim: int,
        key_basis: torch.Tensor | None,
        value_basis: torch.Tensor | None,
        rotator: RopeRotator | None,
        layer_idx: int = 0,
        key_decoder: torch.Tensor | None = None,
    ) -> None:
        if not 1 <= rank <= head_dim:
            raise ConfigError(
                f"low_rank_dim: {rank} with cold_low_rank {mode!r} on layer {layer_idx}; allowed: 1..{head_dim} (head_dim)"
            )
        self.mode = mode
        self.rank = rank
        self.head_dim = head_dim
        self.low_keys = mode in ("keys", "kv")
        self.low_values = mode in ("values", "kv")
        if self.low_keys and rotator is None:
            raise ConfigError(
                f"cold_low_rank: {mode!r} un-rotates keys with the model's RoPE, not found for layer {layer_idx}; "
                "allowed: cold_low_rank: values or none"
            )
        self.rotator = rotator
        self._bases: dict[str, torch.Tensor] = {}
        for name, basis, low in (("key", key_basis, self.low_keys), ("value", value_basis, self.low_values)):
            if not low:
                continue
            if basis is None or basis.dim() != 3 or basis.shape[1] < rank or basis.shape[2] != head_dim:
                shape = None if basis is None else tuple(basis.shape)
                raise ConfigError(
                    f"cold_low_rank: layer {layer_idx}'s {name} basis is {shape}; allowed: [kv_heads, >= {rank}, {head_dim}]"
                )
            self._bases[name] = basis[:, :rank].float().contiguous()  # [Hkv, r, d]
        # decoders: x = dec^T c; the basis itself unless the keys have their own
        self._dec = dict(self._bases)
        if self.low_keys and key_decoder is not None:
            if key_decoder.dim() != 3 or key_decoder.shape[1] < rank or key_decoder.shape[2] != head_dim:
                raise ConfigError(
                    f"cold_low_rank: layer {layer_idx}'s key decoder is {tuple(key_decoder.shape)}; "
                    f"allowed: [kv_heads, >= {rank}, {head_dim}]"
                )
            self._dec["key"] = key_decoder[:, :rank].float().contiguous()
        self.rk = rank if self.low_keys else head_dim  # key columns of a packed row
        self.rv = rank if self.low_values else head_dim
        self.width = cold_elements_per_token(mode, rank, head_dim) // 2  # columns of each store slot
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}

    # ------------------------------------------------------------------ helpers
    def _basis(self, name: str, device: torch.device, decoder: bool = False) -> torch.Tensor:
        """The encoder (or decoder) [Hkv, r, d] on `device` (copied once per device)."""
        key = (name + ("_dec" if decoder else ""), device)
        t = self._on.get(key)
        if t is None:
            t = self._on[key] = (self._dec if decoder else self._bases)[name].to(device)
        return t

    def slots(self, keys: bool, values: bool) -> tuple[bool, bool]:
        """Which store slots (k, v) a read of keys and/or values needs."""
        w = self.width
        need_k = (keys and self.rk > 0) or (values and self.rk < w)
        need_v = values or (keys and self.rk > w)
        return need_k, need_v

    @staticmethod
    def _project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """x [b, h, ..., d] -> coefficients [b, h, ..., r] (float32)."""
        b, h = x.shape[:2]
        c = torch.einsum("bhnd,hrd->bhnr", x.reshape(b, h, -1, x.shape[-1]).float(), basis)
        return c.reshape(*x.shape[:-1], basis.shape[1])

    @staticmethod
    def _lift(c: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """coefficients [b, h, ..., r] -> [b, h, ..., d] (float32)."""
        b, h = c.shape[:2]
        x = torch.einsum("bhnr,hrd->bhnd", c.reshape(b, h, -1, c.shape[-1]).float(), basis)
        return x.reshape(*c.shape[:-1], basis.shape[-1])

    # ------------------------------------------------------------------ coding
    def encode(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [b, h, T, d] (k post-RoPE), pos [T] the tokens' positions -> the store's
        two slots [b, h, T, width] each, in k's dtype."""
        dev = k.device
        if self.low_keys:
            assert self.rotator is not None
            kc = self._project(self.rotator.unrotate(k.float(), pos), self._basis("key", dev))
        else:
            kc = k.float()
        vc = self._project(v, self._basis("value", dev)) if self.low_values else v.float()
        if self.rk == self.rv:  # kv: the slots are the two parts
            return kc.to(k.dtype), vc.to(k.dtype)
        parts = [kc, vc]
        if (self.rk + self.rv) % 2:
            parts.append(kc.new_zeros(*kc.shape[:-1], 1))
        row = torch.cat(parts, dim=-1).to(k.dtype)
        w = self.width
        return row[..., :w].contiguous(), row[..., w:].contiguous()

    def decode(
        self,
        ks: torch.Tensor | None,
        vs: torch.Tensor | None,
        pos: torch.Tensor,
        keys: bool = True,
        values: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The store's slots [b, h, ..., width] (those `slots(keys, values)` names; others
        may be None) and the tokens' positions pos (broadcastable to [b, h, ...]) ->
        k, v [b, h, ..., d] in the slots' dtype (None for a part not asked for); keys
        rotated at pos."""
        like = ks if ks is not None else vs
        assert like is not None
        w, rk, rv = self.width, self.rk, self.rv
        if rk == rv:
            kc, vc = ks, vs
        else:
            # the packed row's columns that are here: [0, w) in ks, [w, 2w) in vs
            row = torch.cat([t for t in (ks, vs) if t is not None], dim=-1)
            off = 0 if ks is not None else w
            kc = row[..., 0 - off : rk - off] if keys else None
            vc = row[..., rk - off : rk + rv - off] if values else None
        k_out = v_out = None
        if keys:
            assert kc is not None and kc.shape[-1] == rk, "keys read without the slots slots() names"
            if self.low_keys:
                assert self.rotator is not None
                k_pre = self._lift(kc, self._basis("key", kc.device, decoder=True))
                k_out = self.rotator.rotate(k_pre, pos).to(like.dtype)
            else:
                k_out = kc
        if values:
            assert vc is not None and vc.shape[-1] == rv, "values read without the slots slots() names"
            v_out = (
                self._lift(vc, self._basis("value", vc.device, decoder=True)).to(like.dtype) if self.low_values else vc
            )
        return k_out, v_out

    def decode_block(self, ks: torch.Tensor, vs: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole stored block [b, h, B, width] x 2 whose first token sits at position
        `start` -> k, v [b, h, B, d]."""
        pos = torch.arange(start, start + ks.shape[-2], device=ks.device)
        k, v = self.decode(ks, vs, pos)
        assert k is not None and v is not None
        return k, v

    def decode_pages(
        self,
        ks: torch.Tensor | None,
        vs: torch.Tensor | None,
        idx: torch.Tensor,
        start: int,
        keys: bool = True,
        values: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Stored pages [b, h, k, P, width] (the slots `slots(keys, values)` names) of page
        ids idx [b, h, k], sealed history starting at position `start` -> k, v
        [b, h, k, P, d] (None for a part not asked for)."""
        like = ks if ks is not None else vs
        assert like is not None
        P = like.shape[-2]
        pos = start + idx.to(like.device)[..., None] * P + torch.arange(P, device=like.device)  # [b, h, k, P]
        return self.decode(ks, vs, pos, keys, values)


def make_latent(
    cfg: FlashMemoryConfig, calibration: Any, layer_idx: int, rotator: RopeRotator | None, head_dim: int
) -> LatentKV | None:
    """The layer's LatentKV under `cfg.cold_low_rank` (None when off); one-line
    ConfigError without a calibration, or with one that lacks the cold bases."""
    mode = cfg.cold_low_rank
    if mode == "none":
        return None
    if calibration is None:
        raise ConfigError(
            f"cold_low_rank: {mode!r} needs a calibration with the cold tier's bases; allowed: set "
            "`calibration:` to a folder written by `flashmem calibrate`, or attach with the model's cached one"
        )
    assert cfg.low_rank_dim is not None  # the config validator requires it
    low_k, low_v = mode in ("keys", "kv"), mode in ("values", "kv")
    if low_k and rotator is None:  # before asking the calibration: the clearer reason
        raise ConfigError(
            f"cold_low_rank: {mode!r} un-rotates keys with the model's RoPE, not found for layer {layer_idx}; "
            "allowed: cold_low_rank: values or none"
        )
    bases = calibration.cold_bases(layer_idx, keys=low_k, values=low_v, key_fit=cfg.cold_key_basis)
    return LatentKV(
        mode,
        cfg.low_rank_dim,
        head_dim,
        bases.get("key_basis"),
        bases.get("value_basis"),
        rotator,
        layer_idx,
        key_decoder=bases.get("key_decoder"),
    )
