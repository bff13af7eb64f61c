"""A retrieval miss taken apart: where the index ranks the needle's pages at the answer step, and the
answers with the selection forced to every page, to the needle's pages, and to the index's 64 best.

    python benchmarks/diagnostics/miss_diagnosis.py passkey kjv 2048 0.5 0 0.0625 [variant] [model]
    python benchmarks/diagnostics/miss_diagnosis.py word_nt - 4096 0.5 21 0.0625 default smollm2

One retrieval-suite prompt (`flashmem_eval.suites.make_probe`: task, haystack,
length, depth, seed), or one of `flashmem_eval.benchkit.probe`'s held-out formats (the
haystack argument unused), on Gemma3-270m (or `model`) with
`FlashMemoryConfig.for_budget(budget, length, model, variant=...)`, fed as the
suite feeds it (context through the cache, then the question, greedy). Prints:

- the answer, and per global layer at the answer step (the question's last
  query) the selected pages and where the index ranks the needle's pages (the page of each occurrence of
  the key's first digits, and the pages before and after);
- the answer again with the selection forced (`cache.selection_hook`) to every
  page, to only the needle's pages, and to the 64 best pages by the index.

Every page answering while the needle's pages alone do not means the selection
is not what is missing: the left-out tokens' share of attention is.
"""

from __future__ import annotations

import argparse

import torch

from flashmem.config import FlashMemoryConfig
from flashmem_eval import harness as H
from flashmem_eval.benchkit import needle_pages, probe
from flashmem_eval.suites import make_probe

SUITE_TASKS = ("passkey", "multikey", "locker")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", help="passkey, multikey, locker, or a benchkit.probe format (e.g. word_nt)")
    ap.add_argument("hay", help="the haystack of a suite task (kjv, stdlib-doc); unused (-) for other formats")
    ap.add_argument("length", type=int, help="context tokens, e.g. 2048")
    ap.add_argument("depth", type=float, help="needle depth, e.g. 0.5")
    ap.add_argument("seed", type=int, help="prompt seed")
    ap.add_argument("budget", type=float, help="resident fraction, e.g. 0.0625")
    ap.add_argument("variant", nargs="?", default="default", help="a for_budget variant (default: the recipe)")
    ap.add_argument("model", nargs="?", default="gemma3-270m", help="a flashmem.load_model name")
    a = ap.parse_args(argv)
    task, hay, length, depth, seed, budget, variant = a.task, a.hay, a.length, a.depth, a.seed, a.budget, a.variant
    torch.set_num_threads(1)
    ld = H.load(a.model)
    tok, model = ld.tokenizer, ld.model
    if task in SUITE_TASKS:
        p = make_probe(tok, task, int(length), float(depth), int(seed), hay=hay)
        context, question, answer_text = p.context, p.question, p.answer
    else:
        context, question, answer_text = probe(tok, task, length, depth, seed, salt=str(length))
    ctx = torch.tensor([tok(context, add_special_tokens=True)["input_ids"]])
    q = torch.tensor([tok(question, add_special_tokens=False)["input_ids"]])
    cfg = FlashMemoryConfig.for_budget(float(budget), int(length), model, variant=variant)
    needle = needle_pages(tok, context, answer_text, cfg.sink_tokens, cfg.page_tokens)
    print(f"answer {answer_text}; context {ctx.shape[1]} tokens; window {cfg.gpu_cache_limit}, {cfg.lsa_top_k} pages")
    print(f"needle pages {needle}")

    def answer(hook=None, config: FlashMemoryConfig = cfg, record: list | None = None) -> str:
        cache, _, _ = H.prefill_flashmem(model, ctx, config)

        def wrapped(layer: int, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if record is not None:
                record.append((layer, idx.clone(), scores.float().clone()))
            return idx if hook is None else hook(idx, scores)

        cache.selection_hook = wrapped
        gen = H.greedy(model, cache, q, 8, [])
        cache.close()
        return repr(tok.decode(gen))

    def forced(pages: list[int] | None):
        """Selection hook attending `pages` (None: every page there is at that step)."""

        def hook(idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            n = scores.shape[-1]
            keep = torch.arange(n) if pages is None else torch.tensor([p for p in pages if p < n])
            return keep.view(1, 1, -1).expand(idx.shape[0], idx.shape[1], -1)

        return hook

    rec: list = []
    print("recipe:", answer(record=rec))
    near = sorted({p + d for p in needle for d in (-1, 0, 1) if p + d >= 0})
    group = model.config.get_text_config().num_attention_heads // rec[0][1].shape[1]
    n_managed = len({r[0] for r in rec})
    answer_step = [r for r in rec if r[2].shape[2] == group][:n_managed]  # the question's last query, alone
    for layer, idx, scores in answer_step:
        mass = torch.softmax(scores * cfg_scaling(model), -1).mean(2)[0]  # [h, pages]
        for h in range(mass.shape[0]):
            order = mass[h].argsort(descending=True).tolist()
            ranks = {p: order.index(p) for p in near if p < len(order)}
            sel = idx[0, h].tolist()
            held = [p for p in needle if p in sel]
            print(f"  layer {layer} head {h}: {len(sel)} selected, needle pages held {held}, ranks {ranks}")
    print("every page:", answer(forced(None)))
    print("needle pages only:", answer(forced(sorted({*needle, *(p + 1 for p in needle)}))))
    print("top 64 by index:", answer(config=cfg.model_copy(update={"lsa_top_k": 64})))


def cfg_scaling(model) -> float:
    """The attention scale of Gemma3's global layers (query_pre_attn_scalar ** -0.5)."""
    c = model.config.get_text_config()
    return float(getattr(c, "query_pre_attn_scalar", c.head_dim)) ** -0.5


if __name__ == "__main__":
    main()
