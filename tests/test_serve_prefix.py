"""Prefix reuse: restored state continues exactly as a fresh prefill; hash chain, restart, quota, pins."""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("prometheus_client")

from flashmem.serve.engine import Engine, Sampling, Sequence  # noqa: E402
from flashmem.serve.prefix import PrefixStore, chain  # noqa: E402
from flashmem_eval.tiny import tiny_tokenizer  # noqa: E402
from serve_helpers import make_engine, tiny_cfg, tiny_model  # noqa: E402
from tiny_models import tiny_gemma3  # noqa: E402

N_LOGITS = 4


def _prompt(n: int, seed: int = 1, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _run(engine: Engine, prompt: list[int], salt: str = "t") -> Sequence:
    seq = Sequence(prompt, Sampling(max_tokens=N_LOGITS, temperature=0), salt, None)
    seq.record_logits = N_LOGITS
    return engine.run_sync(seq)


def _engine(model, cfg, store=None, **kw) -> Engine:
    return Engine(model, tiny_tokenizer(), cfg, model_name="tiny", prefix_store=store, **kw)


@pytest.mark.parametrize(
    "name,model,cfg",
    [
        ("llama", tiny_model, tiny_cfg()),
        ("llama-full-layer-int8-index", tiny_model, tiny_cfg(keep_full_layers=[0], lsa_index_dtype="int8")),
        ("llama-no-band-pages", tiny_model, tiny_cfg(csa_band_tokens=0, lsa_page_tokens=8)),
        ("gemma3-sliding", tiny_gemma3, tiny_cfg()),
        # the prompt attended exactly: a restored prefix rebuilds its K/V from the tiers
        ("llama-exact-prompt", tiny_model, tiny_cfg(prefill_exact_tokens=4096)),
    ],
)
def test_reused_prefix_gives_the_logits_of_a_fresh_prefill(tmp_path, name, model, cfg) -> None:
    m = model()
    prompt = _prompt(150)
    fresh = _run(_engine(m, cfg), prompt)
    # full blocks only: the prompt runs in the chunks of an engine without a store
    blocks = _engine(m, cfg, PrefixStore(tmp_path / "blocks", codec="exact"), end_records=False)
    first = _run(blocks, prompt)
    again = _run(blocks, prompt)
    assert first.reused_tokens == 0
    assert again.reused_tokens == 4 * 32  # every full prefix block before the last token
    assert len(fresh.logits) == len(again.logits) == N_LOGITS
    for a, b in zip(fresh.logits, again.logits):
        assert (a - b).abs().max().item() <= 1e-4  # lossless records: the same logits
    assert again.generated == fresh.generated
    # with end records (the default) the chunk holding the end point stops there, cold or
    # reused: the reused request restores 148 tokens and continues as its cold request did
    served = _engine(m, cfg, PrefixStore(tmp_path / "end", codec="exact"))
    cold = _run(served, prompt)
    reused = _run(served, prompt)
    assert cold.reused_tokens == 0 and reused.reused_tokens == 148
    for a, b in zip(cold.logits, reused.logits):
        assert (a - b).abs().max().item() <= 1e-4
    assert reused.generated == cold.generated


def test_a_changed_middle_token_reuses_only_the_blocks_before_it(tmp_path) -> None:
    m, cfg = tiny_model(), tiny_cfg()
    engine = _engine(m, cfg, PrefixStore(tmp_path, codec="exact"))
    prompt = _prompt(140)
    _run(engine, prompt)
    changed = list(prompt)
    changed[100] = changed[100] % 120 + 4  # in prefix block 3 (tokens 96..127)
    seq = _run(engine, changed)
    assert seq.reused_tokens == 96
    fresh = _run(_engine(m, cfg, PrefixStore(tmp_path / "fresh", codec="exact")), changed)  # cold, same chunks
    for a, b in zip(fresh.logits, seq.logits):
        assert (a - b).abs().max().item() <= 1e-4


def test_hash_chain_names_the_whole_prefix() -> None:
    a = _prompt(96)
    keys = chain(a, 32, "fp", "salt")
    assert len(keys) == 3 and len(set(keys)) == 3
    b = list(a)
    b[40] += 1
    kb = chain(b, 32, "fp", "salt")
    assert kb[0] == keys[0] and kb[1] != keys[1] and kb[2] != keys[2]  # a change reaches every later key
    assert chain(a, 32, "fp", "other")[0] != keys[0]  # tenant salt
    assert chain(a, 32, "fp2", "salt")[0] != keys[0]  # model/config fingerprint
    assert chain(a, 32, "fp", "salt", limit=2) == keys[:2]


def test_stored_prefixes_survive_a_restart(tmp_path) -> None:
    m, cfg = tiny_model(), tiny_cfg()
    prompt = _prompt(150)
    _run(_engine(m, cfg, PrefixStore(tmp_path)), prompt)
    # A new process: a new engine and store over the same folder, a model built again.
    restarted = _engine(tiny_model(), cfg, PrefixStore(tmp_path))
    assert _run(restarted, prompt).reused_tokens == 148  # 4 blocks of 32 and the end record
    # Another config changes the numbers: nothing of the first one is reused.
    other = _engine(m, tiny_cfg(lsa_top_k=3), PrefixStore(tmp_path))
    assert _run(other, prompt).reused_tokens == 0


def test_damaged_record_is_a_miss_not_a_failure(tmp_path) -> None:
    m, cfg = tiny_model(), tiny_cfg()
    store = PrefixStore(tmp_path)
    engine = _engine(m, cfg, store)
    prompt = _prompt(100)
    fresh = _run(engine, prompt)
    victim = sorted(tmp_path.glob("*.fmprefix"))[0]
    victim.write_bytes(b"garbage")
    seq = _run(engine, prompt)
    assert seq.finish_reason in ("length", "stop") and seq.generated == fresh.generated


def _record(nbytes: int) -> dict[str, torch.Tensor]:
    return {"x": torch.zeros(nbytes // 4, dtype=torch.float32)}


def test_quota_evicts_least_recently_used_and_never_pinned(tmp_path) -> None:
    store = PrefixStore(tmp_path, quota_bytes=10_000)
    for k in ("a", "b", "c"):
        store.save(k, "", _record(3000))
        time.sleep(0.01)
    store.load(["a"])  # a is now the most recently used
    store.pin(["b"])
    store.save("d", "", _record(3000))  # over quota: the LRU unpinned one (c) goes
    assert "c" not in store and {"a", "b", "d"} <= {k for k in ("a", "b", "d") if k in store}
    assert store.nbytes() <= 10_000
    store.save("e", "", _record(3000))  # b is the oldest but pinned: a goes
    assert "b" in store and "a" not in store
    store.unpin(["b"])
    store.save("f", "", _record(3000))
    assert "b" not in store
    assert not any(p.suffix == ".tmp" for p in tmp_path.iterdir())
    assert len(list(tmp_path.glob("*.fmprefix"))) == len(store)


def test_live_sequence_pins_its_prefix(tmp_path) -> None:
    engine = make_engine(tmp_path, quota=1)  # every unpinned record is evicted at once
    prompt = _prompt(100)
    seq = Sequence(prompt, Sampling(max_tokens=50, temperature=0), "t", None)
    engine._admit(seq)
    while seq.pos < seq.prompt_tokens:
        engine._unit(seq)
    assert len(engine.prefix_store) == 4  # 3 blocks and the end record, pinned while the sequence lives
    engine._finish(seq, "cancelled")
    assert len(engine.prefix_store) == 0
    assert seq.cache is None


def test_restart_folder_with_leftover_tmp_is_cleaned(tmp_path) -> None:
    (tmp_path / "abc.123.tmp").write_bytes(b"half")
    store = PrefixStore(tmp_path)
    assert len(store) == 0 and not (tmp_path / "abc.123.tmp").exists()
    os.sync()


def test_a_vanished_prefix_folder_costs_reuse_not_the_request(tmp_path) -> None:
    import shutil

    engine = make_engine(tmp_path / "p")
    shutil.rmtree(tmp_path / "p")  # e.g. cleaned by hand while the server runs
    seq = _run(engine, _prompt(100))
    assert seq.finish_reason in ("length", "stop") and len(seq.generated) + (seq.finish_reason == "stop") >= 1
