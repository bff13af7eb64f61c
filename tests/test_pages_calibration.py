"""Page scoring, low-precision index vectors, calibration and the calibrated scorers."""

from __future__ import annotations

import json

import pytest
import torch

import flashmem
import flashmem.calibration
from flashmem.calibration import calibrate, load_calibration
from flashmem.calibration.fit import key_pca, qk_init
from flashmem.errors import ConfigError
from flashmem.index.base import ScorerContext
from flashmem.index.lowrank import LowRankScorer
from test_cache import ALL_EXACT, SMALL, reference, run
from tiny_models import tiny_llama


class _Tok:
    """Character-level stand-in tokenizer for the tiny models (ids < 128)."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + (ord(c) % 120) for c in text]}


@pytest.fixture(scope="module")
def calib_dir(tmp_path_factory):
    model = tiny_llama()
    out = tmp_path_factory.mktemp("cal")
    calibrate(model, _Tok(), tokens=512, seq_tokens=256, rank=16, steps=5, window=16, out=out, progress=False)
    return out


@pytest.mark.parametrize("page", [4, 8])
@pytest.mark.parametrize("precision", ["model", "int8"])
def test_pages_all_selected_equal_dynamic_cache(page, precision):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200))
    ref = reference(model, ids, 24)
    cache = flashmem.attach(
        model, flashmem.FlashMemoryConfig(**ALL_EXACT, lsa_page_tokens=page, lsa_index_dtype=precision)
    )
    out = run(model, cache, ids, 24)
    assert (out - ref).abs().max() <= 1e-4


def test_page_selection_attends_fewer_tokens_than_block_selection():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200))
    blocks = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, lsa_top_k=2))
    run(model, blocks, ids, 2)
    pages = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, lsa_top_k=2, lsa_page_tokens=4))
    run(model, pages, ids, 2)
    # two 4-token pages instead of two 16-token blocks per layer, batch and KV head
    ws_b, ws_p = blocks.memory_report()["tiers"]["working_set"], pages.memory_report()["tiers"]["working_set"]
    assert ws_p * 4 == ws_b


def test_int8_index_is_smaller_and_ranks_like_the_exact_one():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300))
    reports = {}
    for precision in ("model", "int8"):
        cache = flashmem.attach(
            model,
            flashmem.FlashMemoryConfig(
                **SMALL, lsa_scorer="mean_key", lsa_top_k=3, lsa_page_tokens=8, lsa_index_dtype=precision
            ),
        )
        run(model, cache, ids, 1)
        layer = cache.flash_layers[0]
        reports[precision] = (cache.memory_report()["tiers"]["index"], layer.ws_idx.clone())
    (fp_bytes, fp_idx), (q_bytes, q_idx) = reports["model"], reports["int8"]
    d = 16  # tiny_llama head dim
    assert q_bytes * 4 * d == fp_bytes * (d + 2)  # fp32 -> one byte per element + fp16 scale
    assert (fp_idx == q_idx).float().mean() >= 0.9


def test_hca_key_cannot_score_pages():
    with pytest.raises(ConfigError, match="lsa_page_tokens"):
        flashmem.FlashMemoryConfig(lsa_scorer="hca_key", hca_chunk_size=64, lsa_page_tokens=16)
    with pytest.raises(ConfigError, match="lsa_page_tokens"):
        flashmem.FlashMemoryConfig(hca_chunk_size=64, lsa_page_tokens=24)


def test_key_pca_is_orthonormal_and_qk_init_is_exact_at_full_rank():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(500, 8, generator=g) @ torch.randn(8, 8, generator=g)
    q = torch.randn(400, 8, generator=g) @ torch.randn(8, 8, generator=g)
    u = key_pca(k, 8)
    assert torch.allclose(u @ u.T, torch.eye(8), atol=1e-4)
    a, b = qk_init(q, k, 8)
    assert torch.allclose((q @ a.T) @ (k @ b.T).T, q @ k.T, atol=1e-3, rtol=1e-3)


def test_full_rank_token_pages_rank_exactly_as_dense_attention():
    """A full-rank basis and 1-token pages: the index's page scores are q.k itself."""
    h, d = 2, 16
    basis = torch.linalg.qr(torch.randn(d, d))[0].T.expand(h, d, d).contiguous()
    cfg = flashmem.FlashMemoryConfig(hca_chunk_size=16, csa_chunk_size=1, lsa_page_tokens=1, low_rank_dim=d)
    ctx = ScorerContext(layer_idx=0, kv_heads=h, head_dim=d, cfg=cfg, calibration={"key_basis": basis})
    scorer = LowRankScorer(ctx)
    keys = torch.randn(1, h, 64, d)
    q = torch.randn(1, h, 3, d)
    pages = keys.view(1, h, 64, 1, d).transpose(1, 2).reshape(64, h, 1, d)
    summ = scorer.summarize(pages, torch.ones(64, 1, dtype=torch.bool)).view(1, 64, h, 1, d).transpose(1, 2)
    scores = scorer.score(q, summ, 0.25)
    dense = q @ keys.transpose(-1, -2)
    assert torch.allclose(scores, dense, atol=1e-4)
    assert torch.equal(scores.argsort(-1), dense.argsort(-1))


def test_calibration_round_trip_gives_the_same_scores(calib_dir, tmp_path):
    model = tiny_llama()
    cal = load_calibration(calib_dir)
    man = json.loads((calib_dir / "manifest.json").read_text())
    assert man["model_fingerprint"] == cal.manifest["model_fingerprint"] and man["rank"] == 16
    assert set(man) >= {"text", "tokens", "date", "layers", "indexer_kl"}
    cal.save(tmp_path / "copy")
    again = load_calibration(tmp_path / "copy")
    for name, t in cal.tensors.items():
        assert torch.equal(t, again.tensors[name])
    ids = torch.randint(0, 128, (1, 160))
    outs = []
    for folder in (calib_dir, tmp_path / "copy"):
        cache = flashmem.attach(
            model,
            flashmem.FlashMemoryConfig(
                **SMALL, lsa_scorer="learned", lsa_top_k=2, lsa_page_tokens=4, calibration=str(folder)
            ),
        )
        outs.append(run(model, cache, ids, 3))
    assert torch.equal(outs[0], outs[1])


def test_calibration_of_another_model_is_a_one_line_error(calib_dir):
    other = tiny_llama(seed=1)
    cfg = flashmem.FlashMemoryConfig(**SMALL, lsa_scorer="lowrank", calibration=str(calib_dir))
    with pytest.raises(ConfigError, match="calibration: made for model") as exc:
        flashmem.attach(other, cfg)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("scorer", ["lowrank", "learned"])
def test_calibrated_scorers_are_exact_when_every_page_is_selected(scorer, calib_dir):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200))
    ref = reference(model, ids, 16)
    cfg = flashmem.FlashMemoryConfig(**ALL_EXACT, lsa_scorer=scorer, lsa_page_tokens=4, calibration=str(calib_dir))
    out = run(model, flashmem.attach(model, cfg), ids, 16)
    assert (out - ref).abs().max() <= 1e-4


def test_missing_calibration_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(flashmem.calibration.AUTO_SETTINGS, "tokens", 512)
    monkeypatch.setitem(flashmem.calibration.AUTO_SETTINGS, "steps", 3)
    with pytest.raises(ConfigError, match="flashmem calibrate"):
        flashmem.attach(tiny_llama(), flashmem.FlashMemoryConfig(**SMALL, lsa_scorer="lowrank"))
    cache = flashmem.attach(tiny_llama(), flashmem.FlashMemoryConfig(**SMALL, lsa_scorer="lowrank"), tokenizer=_Tok())
    assert cache.flash_layers[0].scorer.rank == 16
    assert any((tmp_path / "calibrations").iterdir())
