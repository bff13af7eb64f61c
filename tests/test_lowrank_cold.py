"""The low-rank cold tier (`cold_low_rank`): sealed blocks kept as calibrated coefficients.

Anchors: at full rank (r = head_dim) the bases are orthonormal, so every read path
gives the exact cold tier's logits; below it a read returns exactly the PCA
projection of the stored K/V (keys projected before RoPE and rotated back at
their own positions); the store's bytes are what the calculator predicts.
"""

from __future__ import annotations

import json

import pytest
import torch

import flashmem
from flashmem.cache.latent import LatentKV
from flashmem.calibration import calibrate, load_calibration
from flashmem.errors import ConfigError
from flashmem.rope import find_rotator
from flashmem.sizing.calculator import cold_elements_per_token, estimate
from test_cache import ALL_EXACT, SMALL, reference, run
from test_pages_calibration import _Tok
from tiny_models import tiny_llama

torch.set_num_threads(1)

D = 16  # tiny_llama's head_dim
PROMPT, STEPS = 200, 12


@pytest.fixture(scope="module")
def cal_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal")
    # steps=0: the indexer is not what these tests use; the cold bases are closed-form
    calibrate(tiny_llama(), _Tok(), tokens=512, seq_tokens=256, rank=8, steps=0, window=16, out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def model_ids_ref():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    return model, ids, reference(model, ids, STEPS)


def lr_cfg(cal_dir, mode="kv", r=D, **kw) -> flashmem.FlashMemoryConfig:
    return flashmem.FlashMemoryConfig(
        **{**ALL_EXACT, **kw}, cold_low_rank=mode, low_rank_dim=r, calibration=str(cal_dir)
    )


# Read paths: the memory arena's page gather (default), whole blocks through the
# prefetcher (disk), whole blocks from a coded store (no arena), re-rank candidates' keys.
PATHS = {
    "arena": {},
    "arena_pages": {"lsa_page_tokens": 4},
    "disk_prefetch": {"cold_store": "disk"},
    "candidates": {"lsa_page_tokens": 4, "lsa_rerank": 2},
    "blocks_no_prefetch": {"cold_store": "disk", "prefetch_threads": 0},
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("mode", ["kv", "keys", "values"])
def test_full_rank_is_exact_on_every_read_path(mode, path, cal_dir, model_ids_ref, tmp_path):
    model, ids, ref = model_ids_ref
    kw = dict(PATHS[path])
    if kw.get("cold_store") == "disk":
        kw["cold_dir"] = str(tmp_path)
    cache = flashmem.attach(model, lr_cfg(cal_dir, mode, D, **kw))
    out = run(model, cache, ids, STEPS)
    layer = cache.flash_layers[0]
    assert layer.latent is not None and layer.num_sealed >= 8  # the cold tier is in use
    assert (out - ref).abs().max() <= 1e-4
    cache.close()


def test_full_rank_equals_the_exact_cold_tier_when_not_everything_is_selected(cal_dir, model_ids_ref):
    """Selection and re-ranking see the same K/V, so they pick the same pages."""
    model, ids, _ = model_ids_ref
    kw = dict(SMALL, lsa_page_tokens=4, lsa_top_k=3, lsa_rerank=2)
    exact = run(model, flashmem.attach(model, flashmem.FlashMemoryConfig(**kw)), ids, STEPS)
    low = run(model, flashmem.attach(model, lr_cfg(cal_dir, "kv", D, **{**kw, "lsa_keep_ratio": 0.135})), ids, STEPS)
    assert (low - exact).abs().max() <= 1e-4


def brute_force(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cal, layer: int, r: int, rot, fit: str):
    """Code K (pre-RoPE) and V [b, h, T, d] on the calibration's top-r directions by hand."""
    t = cal.tensors
    if fit == "pca":
        ek = dk = t[f"layer.{layer}.key_basis_pre"][:, :r]  # [h, r, d]
    else:
        ek, dk = t[f"layer.{layer}.key_enc_pre"][:, :r], t[f"layer.{layer}.key_dec_pre"][:, :r]
    uv = t[f"layer.{layer}.value_basis"][:, :r]
    pk = torch.einsum("hrd,hre->hde", ek, dk)  # x -> x E^T D per head
    pv = torch.einsum("hrd,hre->hde", uv, uv)
    k_pre = rot.unrotate(k, pos)
    k_hat = rot.rotate(torch.einsum("bhtd,hde->bhte", k_pre, pk), pos)
    v_hat = torch.einsum("bhtd,hde->bhte", v, pv)
    return k_hat, v_hat, k_pre, pk, pv


@pytest.mark.parametrize("fit", ["pca", "attention"])
@pytest.mark.parametrize("r", [4, 11])
def test_reads_below_full_rank_return_the_projection(r, fit, cal_dir, model_ids_ref):
    model, ids, _ = model_ids_ref
    cal = load_calibration(cal_dir)
    kw = dict(ALL_EXACT, lsa_page_tokens=4)
    exact = flashmem.attach(model, flashmem.FlashMemoryConfig(**kw))
    run(model, exact, ids, 0)
    low = flashmem.attach(model, lr_cfg(cal_dir, "kv", r, cold_key_basis=fit, **kw))
    run(model, low, ids, 0)
    # layer 0: its K/V depend on the tokens only (later layers see attention that read the low-rank tier)
    le, ll = exact.flash_layers[0], low.flash_layers[0]
    rot = find_rotator(model, "full_attention", D)
    B, S = ll.cfg.hca_chunk_size, ll.block_start
    j = 3
    k, v = le.fetch_block(j)  # the exact block
    pos = torch.arange(S + j * B, S + (j + 1) * B)
    k_hat, v_hat, k_pre, pk, pv = brute_force(k, v, pos, cal, 0, r, rot, fit)
    got_k, got_v = ll.fetch_block(j)  # whole-block read
    assert torch.allclose(got_k, k_hat, atol=1e-5) and torch.allclose(got_v, v_hat, atol=1e-5)
    # the error is the code's residual: what the top-r directions leave out of the pre-RoPE key
    resid = (k_pre - torch.einsum("bhtd,hde->bhte", k_pre, pk)).square().sum(-1)
    assert torch.allclose((got_k - k).square().sum(-1), resid, atol=1e-5)
    assert resid.mean() > 1e-4  # below full rank something is lost, and it is measured
    # page reads from the arena (what selection and re-ranking use) give the same rows
    ppb = ll.cfg.pages_per_block
    idx = torch.tensor([[[j * ppb + 1, (j + 2) * ppb]]]).expand(1, ll.win_k.shape[1], 2)
    pk_got, pv_got = ll.reader.arena_pages(idx)
    assert torch.allclose(pk_got[:, :, 0], got_k[:, :, 4:8], atol=1e-5)
    assert torch.allclose(pv_got[:, :, 0], got_v[:, :, 4:8], atol=1e-5)
    k2, _ = ll.fetch_block(j + 2)
    assert torch.allclose(pk_got[:, :, 1], k2[:, :, :4], atol=1e-5)
    keys_only = ll.reader.arena_pages(idx, values=False)  # the re-rank candidates' read
    assert keys_only[1] is None and torch.allclose(keys_only[0], pk_got, atol=1e-6)


def test_pre_rope_basis_fits_keys_better_than_the_post_rope_one(cal_dir):
    """Why keys are coded before RoPE: at equal rank the pre-RoPE basis leaves less out
    of the calibration keys than a basis of the rotated keys would (energy past r)."""
    cal = load_calibration(cal_dir)
    pre = cal.tensors["layer.0.key_energy_pre"]  # [h, d] descending
    assert torch.all(pre[:, :-1] >= pre[:, 1:] - 1e-7)
    tail_pre = pre[:, 8:].sum(-1) / pre.sum(-1)
    assert torch.all(tail_pre < 0.5)


def test_attention_weighted_key_code_has_less_logit_error_than_pca():
    """Keys that vary most along directions the queries ignore: PCA keeps those, the
    attention-weighted code keeps what moves q.k. Both exact at full rank."""
    from flashmem.calibration.fit import logit_weighted_basis, second_moment_basis

    g = torch.Generator().manual_seed(0)
    d, r = 8, 3
    keys = torch.randn(4000, d, generator=g) * torch.tensor([5.0, 4, 3, 1, 1, 1, 1, 1])
    queries = torch.randn(4000, d, generator=g) * torch.tensor([0.1, 0.1, 0.1, 3, 2, 1, 1, 1])
    enc, dec = logit_weighted_basis(keys, queries)
    u, _ = second_moment_basis(keys)

    def logit_err(e: torch.Tensor, dd: torch.Tensor) -> float:
        k_hat = keys @ e.T @ dd
        return float(((queries[:500] @ (keys - k_hat).T) ** 2).mean())

    assert logit_err(enc[:r], dec[:r]) < 0.5 * logit_err(u[:r], u[:r])
    assert logit_err(enc, dec) < 1e-8 and logit_err(u, u) < 1e-8


@pytest.mark.parametrize("mode", ["kv", "keys", "values"])
def test_rope_round_trip_a_key_comes_back_rotated_at_its_position(mode, cal_dir):
    cal = load_calibration(cal_dir)
    rot = find_rotator(tiny_llama(), "full_attention", D)
    want_k, want_v = mode in ("kv", "keys"), mode in ("kv", "values")
    bases = cal.cold_bases(0, keys=want_k, values=want_v, key_fit="attention")
    lat = LatentKV(
        mode, D, D, bases.get("key_basis"), bases.get("value_basis"), rot, key_decoder=bases.get("key_decoder")
    )
    g = torch.Generator().manual_seed(0)
    k_pre = torch.randn(1, 2, 1, D, generator=g).expand(1, 2, 5, D)  # one pre-RoPE key ...
    pos = torch.tensor([7, 100, 1000, 5000, 20000])  # ... stored at five positions
    k = rot.rotate(k_pre, pos)
    v = torch.randn(1, 2, 5, D, generator=g)
    ks, vs = lat.encode(k, v, pos)
    if want_k:  # coded before RoPE: the same key at every position has the same coefficients
        kc = ks if mode == "kv" else ks[..., :D]
        assert torch.allclose(kc, kc[:, :, :1].expand_as(kc), atol=1e-4)
    got_k, got_v = lat.decode(ks, vs, pos)
    assert torch.allclose(got_k, k, atol=1e-4) and torch.allclose(got_v, v, atol=1e-5)
    moved, _ = lat.decode(ks, vs, pos + 1)  # read at another position: rotated there
    if want_k:
        assert torch.allclose(moved, rot.rotate(k_pre, pos + 1), atol=1e-4)
        assert not torch.allclose(moved, k, atol=1e-2)
    else:  # exact keys are stored rotated already
        assert torch.equal(moved, got_k)


@pytest.mark.parametrize("mode,r,width", [("kv", 5, 5), ("keys", 6, 11), ("values", 5, 11), ("keys", 16, 16)])
def test_unequal_parts_are_packed_into_two_equal_store_slots(mode, r, width, cal_dir):
    cal = load_calibration(cal_dir)
    rot = find_rotator(tiny_llama(), "full_attention", D)
    bases = cal.cold_bases(0, keys=True, values=True)
    lat = LatentKV(mode, r, D, bases["key_basis"], bases["value_basis"], rot)
    assert lat.width == width == cold_elements_per_token(mode, r, D) // 2
    k, v = torch.randn(2, 2, 8, D), torch.randn(2, 2, 8, D)
    pos = torch.arange(30, 38)
    ks, vs = lat.encode(k, v, pos)
    assert ks.shape == vs.shape == (2, 2, 8, width)
    full_k, full_v = lat.decode(ks, vs, pos)
    need_k, need_v = lat.slots(True, False)
    only_k, none_v = lat.decode(ks if need_k else None, vs if need_v else None, pos, values=False)
    assert none_v is None and torch.equal(only_k, full_k)
    need_k, need_v = lat.slots(False, True)
    none_k, only_v = lat.decode(ks if need_k else None, vs if need_v else None, pos, keys=False)
    assert none_k is None and torch.equal(only_v, full_v)
    if mode == "keys":  # the exact part comes back exactly
        assert torch.allclose(full_v, v, atol=1e-6)
    if mode == "values":
        assert torch.allclose(full_k, k, atol=1e-5)


# --------------------------------------------------------------------- bytes
@pytest.mark.parametrize(
    "mode,r,codec", [("kv", 4, "exact"), ("keys", 5, "exact"), ("values", 8, "exact"), ("kv", 8, "int8")]
)
def test_store_bytes_are_what_the_calculator_predicts(mode, r, codec, cal_dir):
    model = tiny_llama()
    # 32-token blocks: the int8 codec's per-channel key groups (32 tokens) are full
    cfg = lr_cfg(cal_dir, mode, r, cold_codec=codec, lsa_keep_ratio=0.2, hca_chunk_size=32)
    cache = flashmem.attach(model, cfg)
    run(model, cache, torch.randint(0, 128, (1, 150)), 3)
    rep = cache.memory_report()
    est = estimate(model.config, tokens=153, config=cfg, dtype="float32").flashmem
    assert cache.flash_layers[0].num_sealed >= 3
    assert est is not None and est.cold_layout == f"{mode} r={r}"
    if codec == "exact":
        assert rep["cold_bytes"] == est.cold_bytes
        exact_cfg = flashmem.FlashMemoryConfig(**{**ALL_EXACT, "hca_chunk_size": 32})
        exact_est = estimate(model.config, tokens=153, config=exact_cfg, dtype="float32")
        assert est.cold_bytes * 2 * D == exact_est.flashmem.cold_bytes * cold_elements_per_token(mode, r, D)
    else:  # int8: 1 byte + a 4-byte scale per 32 elements; 8 value coefficients padded to 32
        assert rep["cold_bytes"] == est.cold_bytes
        assert est.cold_bytes_per_token == 2 * 2 * (8 + 32) * 1.125  # layers x KV heads x elements x bytes
    cache.close()


def test_estimate_cli_shows_the_low_rank_layout(tmp_path, capsys):
    from test_cli_estimate import run as cli

    yml = tmp_path / "c.yaml"
    yml.write_text("flash_memory:\n  cold_low_rank: kv\n  low_rank_dim: 16\n  gpu_cache_limit: 1024\n")
    args = [
        "estimate",
        "--layers",
        "30",
        "--kv-heads",
        "3",
        "--head-dim",
        "64",
        "--dtype",
        "float32",
        "--tokens",
        "8192",
    ]
    code, out, err = cli(capsys, *args, "--config", str(yml))
    assert code == 0, err
    assert "cold low-rank" in out and "kv r=16" in out
    # 30 layers x 3 KV heads x (16 + 16) coefficients x 4 bytes
    assert "11,520.0" in out


# --------------------------------------------------------------------- errors
def test_bad_configs_are_one_line_errors(cal_dir, tmp_path, monkeypatch):
    def one_line(exc_info, *words):
        msg = str(exc_info.value)
        assert "\n" not in msg
        for w in words:
            assert w in msg, msg

    with pytest.raises(ConfigError) as e:
        flashmem.FlashMemoryConfig(cold_low_rank="kv")
    one_line(e, "cold_low_rank", "low_rank_dim", "allowed")
    with pytest.raises(ConfigError) as e:
        flashmem.FlashMemoryConfig(cold_low_rank="k", low_rank_dim=8)
    one_line(e, "cold_low_rank", "'kv'")
    model = tiny_llama()
    with pytest.raises(ConfigError) as e:  # more than head_dim
        flashmem.attach(model, lr_cfg(cal_dir, "kv", D + 1))
    one_line(e, "low_rank_dim", f"1..{D}")
    # no calibration given and none cached for this model
    monkeypatch.setenv("FLASHMEM_CACHE_DIR", str(tmp_path / "models"))
    with pytest.raises(ConfigError) as e:
        flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, cold_low_rank="kv", low_rank_dim=4))
    one_line(e, "flashmem calibrate")
    # a calibration made before the cold bases (format 1): recalibrate
    old = tmp_path / "old"
    cal = load_calibration(cal_dir)
    keep = {k: t for k, t in cal.tensors.items() if not any(n in k for n in ("_pre", "value_"))}
    type(cal)({**cal.manifest, "format": 1}, keep).save(old)
    assert json.loads((old / "manifest.json").read_text())["format"] == 1
    with pytest.raises(ConfigError) as e:
        flashmem.attach(model, lr_cfg(old, "values", 4))
    one_line(e, "format 1", "recalibrate", "flashmem calibrate")
    # an old calibration still serves the scorers
    flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, lsa_scorer="lowrank", calibration=str(old)))
    # a format-2 calibration without the attention-weighted key code: recalibrate, or pca
    no_w = tmp_path / "no_w"
    type(cal)(cal.manifest, {k: t for k, t in cal.tensors.items() if "_enc_" not in k}).save(no_w)
    with pytest.raises(ConfigError) as e:
        flashmem.attach(model, lr_cfg(no_w, "keys", 4))
    one_line(e, "cold_key_basis", "recalibrate", "pca")
    flashmem.attach(model, lr_cfg(no_w, "keys", 4, cold_key_basis="pca"))
    with pytest.raises(ConfigError) as e:
        lr_cfg(cal_dir, "keys", 4, cold_key_basis="svd")
    one_line(e, "cold_key_basis", "'attention'", "'pca'")
    # keys need the model's RoPE
    with pytest.raises(ConfigError) as e:
        LatentKV("keys", 4, D, torch.zeros(2, D, D), None, None, layer_idx=3)
    one_line(e, "RoPE", "layer 3", "cold_low_rank: values")
