"""End records in the engine (prefix.end_point / end_key, Engine._admit / _prefill_chunk): a
repeated prompt restores all but its last END_TAIL tokens, on either admission path; a damaged
end record costs reuse, never the answer; tenants never share one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("prometheus_client")

from flashmem.serve.engine import Engine, Sampling, Sequence  # noqa: E402
from flashmem.serve.prefix import END_TAIL, SUFFIX, PrefixStore, chain, end_key  # noqa: E402
from flashmem_eval.tiny import tiny_tokenizer  # noqa: E402
from serve_helpers import tiny_cfg, tiny_model  # noqa: E402

N = 150  # 4 blocks of 32 (128 tokens) and 22 more: not a multiple of the block size


def _prompt(n: int = N, seed: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


def _engine(tmp_path, **kw) -> Engine:
    store = PrefixStore(tmp_path, codec=kw.pop("codec", "exact"))
    return Engine(tiny_model(), tiny_tokenizer(), tiny_cfg(), model_name="tiny", prefix_store=store, **kw)


def _prefilled(engine: Engine) -> float:
    """Prompt tokens the engine computed so far (its /metrics counter)."""
    v = engine.metrics.registry.get_sample_value("flashmem_prefill_tokens_total")
    return float(v or 0.0)


def _run(engine: Engine, prompt: list[int], salt: str = "t") -> tuple[Sequence, float]:
    """Run one greedy request; (the sequence, the prompt tokens it computed)."""
    before = _prefilled(engine)
    seq = Sequence(prompt, Sampling(max_tokens=6, temperature=0), salt, None)
    seq.record_logits = 6
    engine.run_sync(seq)
    assert seq.finish_reason in ("length", "stop"), seq.finish_reason
    return seq, _prefilled(engine) - before


def test_a_repeated_prompt_runs_only_its_last_tokens(tmp_path) -> None:
    engine = _engine(tmp_path)
    cold, cold_tokens = _run(engine, _prompt())
    again, again_tokens = _run(engine, _prompt())
    assert cold.reused_tokens == 0 and cold_tokens == N
    assert again.reused_tokens == N - END_TAIL and again_tokens == END_TAIL
    assert again.generated == cold.generated and len(cold.generated) == 6
    for a, b in zip(cold.logits, again.logits):
        assert (a - b).abs().max().item() <= 1e-4  # exact records: the cold request's numbers
    # 4 block records and the end record, the end record keyed after the last block
    assert len(engine.prefix_store) == 5
    assert again.end_key == end_key(cold.keys[-1], _prompt()[128 : N - END_TAIL], engine.fingerprint, "t")


def test_int8_records_give_the_cold_requests_greedy_tokens(tmp_path) -> None:
    engine = _engine(tmp_path, codec="int8")  # the default codec
    cold, _ = _run(engine, _prompt())
    again, again_tokens = _run(engine, _prompt())
    assert again_tokens == END_TAIL and again.generated == cold.generated


def test_off_thread_admission_restores_the_end_record_too(tmp_path) -> None:
    engine = _engine(tmp_path, restore_off_thread=True)
    cold, _ = _run(engine, _prompt())
    before = _prefilled(engine)
    seq = Sequence(_prompt(), Sampling(max_tokens=6, temperature=0), "t", None)
    engine.submit(seq)
    while not seq.done.is_set():
        engine.step()
        engine.wait_admitted()
    assert seq.reused_tokens == N - END_TAIL and _prefilled(engine) - before == END_TAIL
    assert seq.generated == cold.generated


def test_a_damaged_end_record_is_prefilled_again_with_the_same_answer(tmp_path) -> None:
    engine = _engine(tmp_path)
    cold, _ = _run(engine, _prompt())
    victim = tmp_path / (cold.end_key + SUFFIX)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    again, again_tokens = _run(engine, _prompt())
    assert again.reused_tokens == 128 and again_tokens == N - 128  # the blocks only: 22 tokens run
    assert again.generated == cold.generated
    assert engine.prefix_store.damaged == 1
    assert victim.read_bytes() != bytes(data)  # removed, then written again by that prefill
    third, third_tokens = _run(engine, _prompt())
    assert third.reused_tokens == N - END_TAIL and third_tokens == END_TAIL
    assert third.generated == cold.generated and engine.prefix_store.damaged == 1


def test_a_missing_end_record_costs_its_tail_only(tmp_path) -> None:
    engine = _engine(tmp_path)
    cold, _ = _run(engine, _prompt())
    (tmp_path / (cold.end_key + SUFFIX)).unlink()
    again, again_tokens = _run(engine, _prompt())
    assert again.reused_tokens == 128 and again_tokens == N - 128 and again.generated == cold.generated
    assert engine.prefix_store.damaged == 0


def test_tenants_do_not_share_end_records(tmp_path) -> None:
    engine = _engine(tmp_path)
    a, _ = _run(engine, _prompt(), salt="tenant-a")
    b, b_tokens = _run(engine, _prompt(), salt="tenant-b")
    assert b.reused_tokens == 0 and b_tokens == N  # the same text, nothing of a's
    assert a.end_key != b.end_key and a.end_key is not None
    # b's own chain, ending in a's end record, is still not a's: the key names the tenant
    b_keys = chain(_prompt(), 32, engine.fingerprint, "tenant-b", limit=(N - 1) // 32)
    assert end_key(b_keys[-1], _prompt()[128 : N - END_TAIL], engine.fingerprint, "tenant-b") == b.end_key
    assert _run(engine, _prompt(), salt="tenant-b")[0].reused_tokens == N - END_TAIL
    assert len(engine.prefix_store) == 10  # 5 records per tenant


def test_a_prompt_one_past_a_block_has_no_end_record(tmp_path) -> None:
    """129 tokens: the last full block ends at 128 and the last token must run anyway."""
    engine = _engine(tmp_path)
    cold, _ = _run(engine, _prompt(129))
    again, again_tokens = _run(engine, _prompt(129))
    assert cold.end_key is None and len(engine.prefix_store) == 4
    assert again.reused_tokens == 128 and again_tokens == 1 and again.generated == cold.generated


def test_end_records_off_reuses_full_blocks_only(tmp_path) -> None:
    engine = _engine(tmp_path, end_records=False)
    cold, _ = _run(engine, _prompt())
    again, again_tokens = _run(engine, _prompt())
    assert again.reused_tokens == 128 and again_tokens == N - 128 and again.generated == cold.generated
    assert len(engine.prefix_store) == 4
