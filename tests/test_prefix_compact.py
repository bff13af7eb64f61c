"""Compact prefix records (format 2): K/V pairs coded as cold-tier blocks, every position stored
once, the cold tier's checksums, and format 1 records (full fp32 copies) refused."""

from __future__ import annotations

import logging

import pytest
import torch
import xxhash
from safetensors.torch import save as st_save

pytest.importorskip("prometheus_client")

from flashmem.errors import ConfigError  # noqa: E402
from flashmem.serve.engine import Engine, Sampling, Sequence  # noqa: E402
from flashmem.serve.prefix import (  # noqa: E402
    CODED,
    MAGIC,
    MAGIC_V1,
    SUFFIX,
    DamagedRecordError,
    OldFormatError,
    PrefixStore,
    chain,
    decode_record,
    encode_record,
    end_key,
    end_point,
)
from flashmem.store import format as coldfmt  # noqa: E402
from flashmem_eval.tiny import TINY_VOCAB, build_llama, tiny_tokenizer  # noqa: E402
from serve_helpers import tiny_cfg, tiny_model  # noqa: E402

N_LOGITS = 4


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


def _run(engine: Engine, prompt: list[int]) -> Sequence:
    seq = Sequence(prompt, Sampling(max_tokens=N_LOGITS, temperature=0), "t", None)
    seq.record_logits = N_LOGITS
    return engine.run_sync(seq)


def _engine(model, cfg, store=None) -> Engine:
    return Engine(model, tiny_tokenizer(), cfg, model_name="tiny", prefix_store=store)


def _raw_records(root, keys: list[str]) -> list[dict[str, torch.Tensor]]:
    return [decode_record(k, (root / (k + SUFFIX)).read_bytes()) for k in keys]


EXACT_PROMPT = tiny_cfg(prefill_exact_tokens=4096)
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=4096,
)


@pytest.mark.parametrize("cfg", [tiny_cfg(), EXACT_PROMPT], ids=["selecting", "exact-prompt"])
def test_int8_records_answer_as_a_fresh_prefill(tmp_path, cfg) -> None:
    m = tiny_model()
    prompt = _prompt(150)
    fresh = _run(_engine(m, cfg), prompt)
    served = _engine(m, cfg, PrefixStore(tmp_path))  # the default codec: int8
    assert served.prefix_store.codec == "int8"
    _run(served, prompt)
    again = _run(served, prompt)
    assert again.reused_tokens == 148  # 4 blocks of 32 and the end record: 2 tokens run
    assert again.generated == fresh.generated
    worst = max((a - b).abs().max().item() for a, b in zip(fresh.logits, again.logits))
    assert worst <= 0.05  # int8 K/V of the prefix: close, not bit for bit (exact: 1e-4, test_serve_prefix)


def test_every_position_is_stored_once_and_int8_is_a_quarter_of_exact(tmp_path) -> None:
    # the recipe's shape of config: the prompt exact, no summaries, an int8 index; head_dim 32
    # (a value is coded in groups of 32 channels: the tiny model's 16 would be padded to 32)
    m = build_llama(0, **{**TINY_LLAMA, "num_attention_heads": 2, "num_key_value_heads": 2})
    cfg = tiny_cfg(prefill_exact_tokens=4096, csa_band_tokens=0, use_summaries=False, lsa_index_dtype="int8")
    prompt = _prompt(150)
    sizes = {}
    for codec in ("exact", "int8"):
        store = PrefixStore(tmp_path / codec, codec=codec)
        seq = _run(_engine(m, cfg, store), prompt)
        sizes[codec] = store.nbytes()
        records = _raw_records(tmp_path / codec, seq.keys)
        for layer in range(2):
            # records 1..4 hold positions 0..127, each once (format 1 repeated the tail in each)
            assert sum(r[f"{layer}.kv.k"].shape[-2] for r in records) == 128
            assert not any(name.startswith(f"{layer}.") and "sink" in name for r in records for name in r)
    # K/V at 1.125 bytes an element against 4; the small parts (index, validity) as they are
    assert sizes["int8"] <= 0.35 * sizes["exact"]


def test_a_pair_is_a_cold_tier_block_with_its_own_checksum() -> None:
    k, v = torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
    data = encode_record("key", "", {"3.kv.k": k, "3.kv.v": v, "3.valid": torch.ones(1, 32, dtype=torch.bool)})
    body = data[len(MAGIC) + 16 :]
    out = decode_record("key", data)
    assert (out["3.kv.k"] - k).abs().max() <= 0.02 and (out["3.kv.v"] - v).abs().max() <= 0.02
    assert out["3.valid"].all()
    # the block's header is the cold tier's (codec int8, fp32, layer 3, shape)
    from safetensors.torch import load as st_load

    coded = st_load(body)["3.kv" + CODED]
    h = coldfmt.unpack_header(coded[: coldfmt.HEADER_SIZE].numpy().tobytes())
    assert h is not None and h.codec == 1 and h.layer == 3 and h.shape == (1, 2, 32, 8)
    # a flipped payload byte under a recomputed outer digest: the block's own xxh64 catches it
    coded[coldfmt.HEADER_SIZE + 5] ^= 0x10
    forged = st_save(st_load(body) | {"3.kv" + CODED: coded}, metadata={"key": "key", "parent": "", "codec": "int8"})
    with pytest.raises(DamagedRecordError, match="payload does not match"):
        decode_record("key", MAGIC + xxhash.xxh3_128_digest(forged) + forged)


def test_a_record_of_another_codec_is_not_used(tmp_path) -> None:
    m, cfg = tiny_model(), tiny_cfg()
    prompt = _prompt(100)
    _run(_engine(m, cfg, PrefixStore(tmp_path, codec="int8")), prompt)
    exact = _engine(m, cfg, PrefixStore(tmp_path, codec="exact"))
    seq = _run(exact, prompt)
    assert seq.reused_tokens == 0 and exact.prefix_store.damaged == 1  # removed, written again as exact
    assert _run(exact, prompt).reused_tokens == 98  # 3 blocks and the end record


def _format_1(key: str, parent: str) -> bytes:
    """A record as format 1 wrote it: full fp32 copies of the state, old tensor names."""
    body = st_save({"0.sink_k": torch.zeros(1, 2, 4, 16)}, metadata={"key": key, "parent": parent})
    return MAGIC_V1 + xxhash.xxh3_128_digest(body) + body


def test_format_1_records_are_refused_with_a_message_never_used(tmp_path, caplog) -> None:
    m, cfg = tiny_model(), tiny_cfg()
    prompt = _prompt(100)
    fresh = _run(_engine(m, cfg), prompt)
    keys = _run(_engine(m, cfg, PrefixStore(tmp_path / "probe")), prompt).keys
    for i, k in enumerate(keys):  # a folder an older server left
        (tmp_path / (k + SUFFIX)).write_bytes(_format_1(k, keys[i - 1] if i else ""))
    with caplog.at_level(logging.WARNING, logger="flashmem.serve.prefix"):
        store = PrefixStore(tmp_path)
    assert "3 records of format 1" in caplog.text
    assert len(store) == 0 and not list(tmp_path.glob("*" + SUFFIX))
    seq = _run(_engine(m, cfg, store), prompt)
    assert seq.reused_tokens == 0 and seq.generated == fresh.generated
    # one met later (copied in while the server runs, or another replica's on a shared store)
    (tmp_path / (keys[0] + SUFFIX)).write_bytes(_format_1(keys[0], ""))
    with pytest.raises(OldFormatError):
        decode_record(keys[0], _format_1(keys[0], ""))
    again = _run(_engine(m, cfg, store), prompt)
    assert again.generated == fresh.generated and store.damaged == 1
    assert _run(_engine(m, cfg, store), prompt).reused_tokens == 98  # computed again, coded


def test_unknown_codec_is_one_line() -> None:
    with pytest.raises(ConfigError, match="allowed: exact, int4, int8"):
        PrefixStore("/tmp/unused-prefix-codec-test", codec="zstd")


def test_end_point_and_key() -> None:
    assert end_point(150, 32) == 148  # after the last full block (128): the end record's place
    assert end_point(130, 32) == 0 and end_point(129, 32) == 0  # no room after block 128..
    assert end_point(131, 32) == 129
    keys = chain(_prompt(150), 32, "fp", "s")
    k = end_key(keys[-1], _prompt(150)[128:148], "fp", "s")
    assert k not in keys
    assert k != end_key(keys[-1], _prompt(150)[128:147], "fp", "s")
    assert k != end_key(keys[-1], _prompt(150)[128:148], "fp", "other-tenant")


@pytest.mark.parametrize("codec", ["exact", "int8"])
def test_state_restored_mid_block_continues_as_the_cache_did(codec) -> None:
    """An end record cuts the state where no block ends (position 148, blocks of 16 and 32):
    every position once, the tail rebuilt from the records; the last two tokens then give the
    logits the original cache gave (exact codec: to 1e-4), and so does the next step."""
    import flashmem
    from flashmem.serve import state

    m, cfg = tiny_model(), EXACT_PROMPT
    prompt = _prompt(150)

    def forward(cache, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return m(torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()

    cache = flashmem.attach(m, cfg)
    records, mark = [], state.mark(cache)
    for a, e in [(0, 32), (32, 64), (64, 96), (96, 128), (128, 148)]:
        forward(cache, prompt[a:e])
        data = encode_record(f"k{e}", "", state.export_delta(cache, mark), codec)
        records.append(decode_record(f"k{e}", data, codec))
        mark = state.mark(cache)
    want = forward(cache, prompt[148:150])
    want_next = forward(cache, [int(want.argmax())])
    restored = flashmem.attach(m, cfg)
    state.import_records(restored, records)
    got = forward(restored, prompt[148:150])
    got_next = forward(restored, [int(got.argmax())])
    tol = 1e-4 if codec == "exact" else 0.05
    assert (want - got).abs().max().item() <= tol
    assert (want_next - got_next).abs().max().item() <= tol
    assert int(want.argmax()) == int(got.argmax())


def test_low_rank_cold_tier_records_its_blocks_in_its_own_form(tmp_path) -> None:
    """A layer whose cold tier holds coefficients (`cold_low_rank`) cannot give its sealed
    blocks' exact K/V back: its records hold the new blocks as the tier holds them and the
    exact tail; the restored state continues as the cache did."""
    import flashmem
    from flashmem.calibration import calibrate
    from flashmem.serve import state
    from test_cache import ALL_EXACT
    from test_pages_calibration import _Tok
    from tiny_models import tiny_llama

    m = tiny_llama()
    calibrate(m, _Tok(), tokens=512, seq_tokens=256, rank=8, steps=0, window=16, out=tmp_path, progress=False)
    cfg = flashmem.FlashMemoryConfig(**ALL_EXACT, cold_low_rank="kv", low_rank_dim=8, calibration=str(tmp_path))
    prompt = _prompt(150)

    def forward(cache, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return m(torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()

    cache = flashmem.attach(m, cfg)
    records, mark = [], state.mark(cache)
    for a, e in [(0, 64), (64, 128), (128, 148)]:
        forward(cache, prompt[a:e])
        records.append(decode_record("k", encode_record("k", "", state.export_delta(cache, mark), "exact"), "exact"))
        mark = state.mark(cache)
    assert cache.flash_layers[0].latent is not None and any(n.endswith(".block.1.k") for n in records[0])
    want = forward(cache, prompt[148:150])
    restored = flashmem.attach(m, cfg)
    state.import_records(restored, records)
    got = forward(restored, prompt[148:150])
    assert (want - got).abs().max().item() <= 1e-4


def test_end_records_reuse_all_but_two_tokens(tmp_path) -> None:
    """The engine's end records (on by default with a store): the same prompt again restores
    all but its last END_TAIL tokens and runs the same forwards from there, so with exact
    records its logits are the cold request's bit for bit, and within float tolerance of an
    engine without a store (no split)."""
    m, cfg = tiny_model(), EXACT_PROMPT
    prompt = _prompt(150)
    fresh = _run(_engine(m, cfg), prompt)
    engine = _engine(m, cfg, PrefixStore(tmp_path, codec="exact"))
    cold, again = _run(engine, prompt), _run(engine, prompt)
    assert cold.reused_tokens == 0 and again.reused_tokens == 148
    assert again.generated == cold.generated == fresh.generated
    assert all(torch.equal(a, b) for a, b in zip(cold.logits, again.logits))
    assert max((a - b).abs().max().item() for a, b in zip(fresh.logits, again.logits)) <= 1e-4
    other = list(prompt)
    other[140] = other[140] % 120 + 4  # after the last full block: the end record is not this prompt's
    assert _run(engine, other).reused_tokens == 128
