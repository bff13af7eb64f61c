"""The engine's continuous batching: sequences join and leave a batched decode, each
answering as alone; a failing row fails alone; prefix restores run off the worker."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

pytest.importorskip("prometheus_client")

from flashmem.serve.engine import Engine, Sampling, Sequence  # noqa: E402
from flashmem.serve.prefix import PrefixStore  # noqa: E402
from flashmem_eval.tiny import tiny_tokenizer  # noqa: E402
from serve_helpers import MODEL, serving, tiny_cfg, tiny_model  # noqa: E402

TOL = 1e-5
EXACT = tiny_cfg(prefill_exact_tokens=4096, gpu_cache_limit=4096)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


def _seq(prompt: list[int], max_tokens: int) -> Sequence:
    seq = Sequence(prompt, Sampling(max_tokens=max_tokens, temperature=0), "t", None)
    seq.record_logits = max_tokens
    return seq


def _engine(model, cfg, **kw) -> Engine:
    return Engine(model, tiny_tokenizer(), cfg, model_name=MODEL, **kw)


def _alone(model, cfg, prompt: list[int], max_tokens: int) -> Sequence:
    return _engine(model, cfg).run_sync(_seq(prompt, max_tokens))


def _until_done(engine: Engine, seqs: list[Sequence], each_round=None) -> None:
    """Run rounds (admissions swapped in after each) until every sequence is done;
    each_round(n) after round n (e.g. to submit more)."""
    rounds = 0
    while not all(s.done.is_set() for s in seqs):
        engine.step()
        engine.wait_admitted()
        rounds += 1
        if each_round is not None:
            each_round(rounds)
        assert rounds < 200


def _same(a: Sequence, b: Sequence) -> None:
    assert a.finish_reason == b.finish_reason and a.generated == b.generated
    assert len(a.logits) == len(b.logits) > 0
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() <= TOL


@pytest.mark.parametrize("cfg", [EXACT, tiny_cfg()], ids=["exact", "selecting"])
def test_sequences_join_and_leave_a_batch_and_answer_as_alone(cfg) -> None:
    model = tiny_model()
    engine = _engine(model, cfg, max_concurrent=4)
    # different prompt lengths (so different positions) and lengths of answer (leave at different rounds)
    specs = [(70, 1, 12), (33, 2, 5), (120, 3, 9), (10, 4, 7)]
    seqs = [_seq(_prompt(n, s), m) for n, s, m in specs]
    engine.submit(seqs[0])
    engine.submit(seqs[1])

    def join(rounds: int) -> None:
        if rounds == 4:  # join while the first two decode
            engine.submit(seqs[2])
            engine.submit(seqs[3])

    _until_done(engine, seqs, join)
    for seq, (n, s, m) in zip(seqs, specs):
        _same(seq, _alone(model, cfg, _prompt(n, s), m))
    assert engine.decode_rows > engine.decode_forwards  # decode steps shared forwards
    assert engine.active == 0
    # /metrics says how full the rounds ran and how long they took
    m = _metrics(engine)
    assert m["flashmem_decode_forwards_total"] == engine.decode_forwards
    assert m["flashmem_decode_rows_total"] == engine.decode_rows
    assert 0 < m["flashmem_decode_forward_seconds_total"] < m["flashmem_worker_busy_seconds_total"]


def _metrics(engine: Engine) -> dict[str, float]:
    lines = engine.metrics.render().decode().splitlines()
    return {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln.startswith("flashmem_") and " " in ln}


def test_max_batch_1_is_one_forward_per_sequence() -> None:
    model = tiny_model()
    engine = _engine(model, EXACT, max_concurrent=3, max_batch=1)
    seqs = [_seq(_prompt(20 + 10 * i, i), 4) for i in range(3)]
    for s in seqs:
        engine.submit(s)
    _until_done(engine, seqs)
    assert engine.decode_rows == engine.decode_forwards > 0
    assert _metrics(engine)["flashmem_decode_rows_total"] == engine.decode_rows
    for i, s in enumerate(seqs):
        _same(s, _alone(model, EXACT, _prompt(20 + 10 * i, i), 4))


def test_a_row_that_fails_mid_batch_fails_only_its_request() -> None:
    model = tiny_model()
    engine = _engine(model, EXACT, max_concurrent=3)
    seqs = [_seq(_prompt(30 + 5 * i, 10 + i), 6) for i in range(3)]
    for s in seqs:
        engine.submit(s)
    while not all(len(s.generated) >= 2 for s in seqs):
        engine.step()
        engine.wait_admitted()
    layer = seqs[1].cache.flash_layers[1]

    def broken(*a, **k):
        raise RuntimeError("disk gone")

    layer.append = broken  # its next decode step raises in layer 1, after attention
    while not all(s.done.is_set() for s in seqs):
        engine.step()
    assert seqs[1].finish_reason == "error"
    for i in (0, 2):
        _same(seqs[i], _alone(model, EXACT, _prompt(30 + 5 * i, 10 + i), 6))


def test_prefix_restore_runs_off_the_worker_while_others_decode(tmp_path) -> None:
    """A restore held up on the admit thread (its records' load waits) while another
    sequence keeps getting tokens; then it is swapped in and answers as a fresh prefill."""
    model, cfg = tiny_model(), EXACT
    store = PrefixStore(tmp_path)
    engine = _engine(model, cfg, prefix_store=store, max_concurrent=2)
    doc = _prompt(150, 7)
    engine.run_sync(_seq(doc, 1))  # stores the prefix blocks
    gate, loading = threading.Event(), threading.Event()
    threads: list[str] = []
    real_load = store.load

    def slow_load(keys):
        threads.append(threading.current_thread().name)
        loading.set()
        assert gate.wait(30)
        return real_load(keys)

    store.load = slow_load  # type: ignore[method-assign]
    other = _seq(_prompt(20, 8), 40)
    engine.submit(other)
    engine.step()
    engine.wait_admitted()
    reused = _seq(doc, 4)
    engine.submit(reused)
    engine.step()  # hands the admission to the helper thread
    assert loading.wait(30)
    before = len(other.generated)
    for _ in range(5):
        engine.step()  # the worker is not blocked by the restore
    assert len(other.generated) == before + 5
    assert reused.pos == 0 and engine.active == 2
    gate.set()
    while not reused.done.is_set():
        engine.step()
        engine.wait_admitted()
    assert threads and threads[0].startswith("flashmem-serve-admit")
    assert reused.reused_tokens == 148  # 4 blocks of 32 and the end record
    # the same records restored on the worker thread give the same answer (whatever their codec)
    store.load = real_load  # type: ignore[method-assign]
    inline = _engine(model, cfg, prefix_store=store, restore_off_thread=False).run_sync(_seq(doc, 4))
    assert inline.reused_tokens == 148
    _same(reused, inline)
    other.cancel()
    engine.step()
    assert other.finish_reason == "cancelled" and engine.active == 0


def test_without_a_prefix_store_a_request_joins_the_round_it_is_admitted_in() -> None:
    """Nothing to restore: the admission (an attach) runs in the round, whose forward gives
    the new sequence its first token beside the others' steps; no helper thread is started."""
    model = tiny_model()
    engine = _engine(model, EXACT)  # restore_off_thread is the default
    other = _seq(_prompt(20, 8), 40)
    engine.submit(other)
    engine.step()
    assert other.generated
    new = _seq(_prompt(30, 9), 4)
    engine.submit(new)
    before = len(other.generated)
    engine.step()
    assert len(new.generated) == 1 and len(other.generated) == before + 1
    assert engine._admitter is None
    while not new.done.is_set():
        engine.step()
    _same(new, _alone(model, EXACT, _prompt(30, 9), 4))
    other.cancel()
    engine.step()


def test_restore_on_the_worker_when_asked(tmp_path) -> None:
    model, cfg = tiny_model(), EXACT
    store = PrefixStore(tmp_path)
    engine = _engine(model, cfg, prefix_store=store, restore_off_thread=False)
    doc = _prompt(100, 9)
    engine.run_sync(_seq(doc, 1))
    seq = _seq(doc, 3)
    engine.submit(seq)
    engine.step()  # admitted (and restored) inside the round, on this thread
    assert seq.reused_tokens == 98 and seq.pos >= 98  # 3 blocks of 32 and the end record
    while not seq.done.is_set():
        engine.step()
    _same(seq, _engine(model, cfg, prefix_store=store).run_sync(_seq(doc, 3)))


def test_concurrent_http_clients_get_their_answers_alone() -> None:
    engine = Engine(tiny_model(), tiny_tokenizer(), EXACT, model_name=MODEL, max_concurrent=4)
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(4)]

    def ask(url: str, prompt: list[int]) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        return str(r.json()["choices"][0]["text"])

    with serving(engine) as url:
        alone = [ask(url, p) for p in prompts]
        got: dict[int, str] = {}
        workers = [threading.Thread(target=lambda i=i: got.__setitem__(i, ask(url, prompts[i]))) for i in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
    assert [got[i] for i in range(4)] == alone
    assert engine.decode_rows > engine.decode_forwards


def test_max_batch_below_1_is_refused() -> None:
    from flashmem.errors import FlashMemError

    with pytest.raises(FlashMemError, match="max_batch 0: allowed: 1"):
        _engine(tiny_model(), EXACT, max_batch=0)


def test_exact_on_doubt_serves_one_forward_per_sequence_and_is_refused_batched() -> None:
    """exact_on_doubt undoes and redoes one cache's forward: with max_batch 1 a selecting server
    redoes every step (threshold 20) and answers with the exact server's logits; batched, it is
    refused when the engine starts."""
    from flashmem.errors import FlashMemError

    model = tiny_model()
    doubt = tiny_cfg(prefill_exact_tokens=4096, exact_on_doubt=20.0, exact_on_doubt_share=1.0)
    with pytest.raises(FlashMemError, match="exact_on_doubt 20.0 redoes one sequence's forward, and max_batch 3"):
        _engine(model, doubt, max_concurrent=3)
    prompt = _prompt(70, 3)
    got = _engine(model, doubt, max_concurrent=3, max_batch=1).run_sync(_seq(prompt, 12))
    _same(got, _alone(model, EXACT, prompt, 12))
    assert not any((x - y).abs().max() <= TOL for x, y in zip(
        _alone(model, tiny_cfg(prefill_exact_tokens=4096), prompt, 12).logits[1:], got.logits[1:]
    ))  # fmt: skip  # selecting alone, no step gives those logits


@pytest.mark.parametrize("cfg", [EXACT, tiny_cfg()], ids=["exact", "selecting"])
def test_prompt_chunks_share_the_decode_forwards_and_answer_as_alone(cfg, tmp_path) -> None:
    """pack_prefill: new requests' prompt chunks (several per prompt, one of them after a
    restored prefix) run in the same forwards as a sequence's decode steps, every row's
    tokens packed; each answers as alone, and the blocks a packed chunk completes are stored
    as a chunk alone stores them (a later request restores them and answers the same)."""
    model = tiny_model()
    store = PrefixStore(tmp_path, codec="exact")
    doc, fresh, chat = _prompt(150, 21), _prompt(110, 22), _prompt(12, 23)
    _engine(model, cfg, prefix_store=store).run_sync(_seq(doc, 1))  # stores doc's blocks
    stored = len(store)
    engine = _engine(model, cfg, prefix_store=store, max_concurrent=3)
    seqs = [_seq(chat, 30), _seq(doc, 6), _seq(fresh, 6)]
    engine.submit(seqs[0])
    while not seqs[0].generated:
        engine.step()
        engine.wait_admitted()
    engine.submit(seqs[1])
    engine.submit(seqs[2])
    _until_done(engine, seqs)
    assert seqs[1].reused_tokens == 148 and seqs[2].reused_tokens == 0
    # fresh's 4 chunks (3 blocks of 32 and the end record's) and doc's tail ran beside chat's steps
    assert engine.packed_chunks >= 5
    assert len(store) > stored  # fresh's blocks and end record, stored from packed chunks
    # alone: chat and fresh cold (fresh's chunks split at its end point, as with a store),
    # doc restored from the same records
    ref = PrefixStore(tmp_path / "ref", codec="exact")
    _same(seqs[0], _engine(model, cfg).run_sync(_seq(chat, 30)))
    _same(seqs[1], _engine(model, cfg, prefix_store=store).run_sync(_seq(doc, 6)))
    _same(seqs[2], _engine(model, cfg, prefix_store=ref).run_sync(_seq(fresh, 6)))
    again = _engine(model, cfg, prefix_store=store).run_sync(_seq(fresh, 6))
    assert again.reused_tokens == 108
    _same(again, seqs[2])


def test_pack_prefill_off_runs_a_forward_per_chunk() -> None:
    model = tiny_model()
    engine = _engine(model, EXACT, max_concurrent=2, pack_prefill=False)
    seqs = [_seq(_prompt(12, 31), 20), _seq(_prompt(90, 32), 4)]
    engine.submit(seqs[0])
    engine.step()
    engine.wait_admitted()
    engine.submit(seqs[1])
    _until_done(engine, seqs)
    assert engine.packed_chunks == 0 and engine.decode_rows > engine.decode_forwards
    for seq, (n, s) in zip(seqs, ((12, 31), (90, 32))):
        _same(seq, _alone(model, EXACT, _prompt(n, s), seq.sampling.max_tokens))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", ["exact", "int8"])
def test_a_half_model_stores_and_restores_its_prefixes(tmp_path, dtype, codec) -> None:
    """`flashmem serve --dtype bfloat16|float16`: the prefix records hold the half K/V (coded or
    not), and the same prompt again restores all but its end and answers as the first time."""
    from flashmem_eval.tiny import tiny_tokenizer as tok

    prompt = _prompt(300, seed=5)
    runs = []
    for _ in range(2):  # a new engine each time: a restarted server on the same folder
        engine = Engine(
            tiny_model().to(dtype), tok(), tiny_cfg(), model_name=MODEL, prefix_store=PrefixStore(tmp_path, codec=codec)
        )
        seq = engine.run_sync(Sequence(prompt, Sampling(max_tokens=6, temperature=0), "t", None))
        runs.append(seq)
    assert runs[0].reused_tokens == 0 and runs[1].reused_tokens >= 256
    assert runs[1].generated == runs[0].generated
