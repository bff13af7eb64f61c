"""Logits and selections of a tiny random Llama through three cache configs, saved for a
bit-for-bit comparison between two checkouts (a refactor's "behaviour unchanged").

Configs: the recipe's keys (16-token pages by int8 mean key, re-rank 4 with a candidate floor,
int8 working set, an exact prompt cap below the prompt), CSA/HCA summaries, and Quest pages read
through the prefetcher. Each: a 200-token prompt, then 60 one-token steps; saved per config are
the 61 last-position logits and the first 4 selected page ids of every layer at every step.

    PYTHONPATH=<checkout>/src python benchmarks/diagnostics/layer_ab.py --save before.pt
    python benchmarks/diagnostics/layer_ab.py --save after.pt
    python benchmarks/diagnostics/layer_ab.py --compare before.pt after.pt
"""

from __future__ import annotations

import argparse

import torch

CONFIGS = {
    "recipe": dict(
        hca_chunk_size=16,
        lsa_scorer="mean_key",
        lsa_page_tokens=4,
        lsa_index_dtype="int8",
        use_summaries=False,
        sink_tokens=4,
        lsa_rerank=4,
        lsa_rerank_min_pages=8,
        working_set_codec="int8",
        lsa_top_k=5,
        gpu_cache_limit=16,
        lsa_follow_pages=1,
        prefill_exact_tokens=64,
        prefill_chunk=32,
        prefetch_threads=0,
    ),
    "summaries": dict(
        hca_chunk_size=16, csa_chunk_size=4, csa_band_tokens=32, gpu_cache_limit=16, lsa_top_k=2, prefill_chunk=32
    ),
    "prefetch": dict(
        hca_chunk_size=16,
        lsa_scorer="quest",
        lsa_page_tokens=8,
        lsa_top_k=3,
        gpu_cache_limit=16,
        prefill_chunk=32,
        prefetch_threads=2,
        lsa_rerank=2,
    ),
}


def run() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    import flashmem
    from flashmem.cache.flash_layer import FlashLayer
    from flashmem_eval.tiny import build_llama

    out = {}
    for name, kw in CONFIGS.items():
        model = build_llama(
            0,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
        ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(5))
        FlashLayer.read_memory_directly = name != "prefetch"  # the prefetcher over a memory store
        cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**kw))
        with torch.no_grad():
            logits = [model(ids[:, :200], cache=cache, use_cache=True).logits[:, -1]]
            sels = []
            for t in range(200, 260):
                logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
                sels.append(torch.stack([layer.ws_idx.flatten()[:4] for layer in cache.flash_layers]))
        FlashLayer.read_memory_directly = True
        out[name] = (torch.cat(logits), torch.stack(sels))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", help="write this checkout's logits and selections here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved files")
    a = p.parse_args(argv)
    if a.save:
        torch.save(run(), a.save)
        print(f"saved {a.save}")
    if a.compare:
        x, y = (torch.load(f) for f in a.compare)
        for name in x:
            diff = float((x[name][0] - y[name][0]).abs().max())
            print(f"{name}: logits max diff {diff:g}, selections equal: {torch.equal(x[name][1], y[name][1])}")
    if not (a.save or a.compare):
        p.error("give --save FILE or --compare A B")


if __name__ == "__main__":
    main()
