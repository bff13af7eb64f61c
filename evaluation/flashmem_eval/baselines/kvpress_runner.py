"""Runs NVIDIA kvpress 0.5.5 presses on benchmark jobs, inside kvpress's own venv.

This file is executed by the venv's python (transformers<5.3), never imported by
flashmem: it must only use the standard library, torch, transformers and kvpress.

    python kvpress_runner.py JOBS.json

JOBS.json: {"model_dir": HF folder, "out": results .jsonl (appended),
"threads": int, "jobs": [{"cell", "kind": "fidelity"|"retrieval", "press",
"compression_ratio", "context": [ids], "cont": [ids] | "question": [ids],
"chunk": int, "max_new": int, "global_layers": [idx]}]}.

Prefill runs under the press (as kvpress's pipeline does: compression during
the context prefill), then continuation/question tokens are fed with explicit
position ids (context_length + i), as kvpress's pipeline does. On models with
sliding-window layers (Gemma3) only the global layers are compressed, the
sliding layers keep transformers' sliding cache, and later tokens are fed one
at a time (see `feed`); ExpectedAttentionPress gets Gemma3's rope layer type
patched in (`_patch_gemma3_rope`). Fidelity metrics
are against an uncompressed run of the same model in this same environment.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback


def main(path: str) -> int:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    spec = json.load(open(path))
    torch.set_num_threads(int(spec.get("threads", 2)))
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation=spec.get("attn", "sdpa")
    ).eval()
    _patch_gemma3_rope(model)
    refs: dict[str, torch.Tensor] = {}

    sliding = bool(set(getattr(model.config, "layer_types", None) or []) & {"sliding_attention"})

    def prefill(ctx, press):
        # Models with sliding-window layers (Gemma3): those keep their own sliding
        # cache and are not compressed (budgets are over the global layers), as
        # kvpress itself does for Gemma3ForConditionalGeneration.
        cache = DynamicCache(config=model.config) if sliding else DynamicCache()
        if press is not None and sliding:
            orig = press.forward_hook

            def hook(module, input, kwargs, output, _orig=orig):
                if getattr(module, "is_sliding", False):
                    return output
                return _orig(module, input, kwargs, output)

            press.forward_hook = hook
        ctxm = press(model) if press is not None else _null()
        with torch.no_grad(), ctxm:
            out = model(input_ids=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[0, -1].float()

    def feed(cache, ids, start):
        # With sliding layers the cache's seq length is the sliding layers' true
        # count while compressed global layers hold fewer entries, so several new
        # tokens at once would see each other in the global layers (no causal
        # mask there); feed them one at a time instead (exact, just slower).
        step = 1 if sliding else ids.shape[1]
        outs = []
        with torch.no_grad():
            for s0 in range(0, ids.shape[1], step):
                part = ids[:, s0 : s0 + step]
                pos = torch.arange(start + s0, start + s0 + part.shape[1]).unsqueeze(0)
                outs.append(model(input_ids=part, past_key_values=cache, position_ids=pos, use_cache=True).logits)
        return _Out(torch.cat(outs, dim=1))

    def cont_logprobs(cache, first, ctx_len, cont, chunk):
        rows = [first.log_softmax(-1).unsqueeze(0)]
        f = cont[:, :-1]
        for s in range(0, f.shape[1], chunk):
            out = feed(cache, f[:, s : s + chunk], ctx_len + s)
            rows.append(out.logits[0].float().log_softmax(-1))
        return torch.cat(rows, 0)[: cont.shape[1]]

    def stored(cache, layers):
        n = [cache.layers[i].keys.shape[-2] for i in layers if i < len(cache.layers)]
        return sum(n) / max(1, len(n))

    with open(spec["out"], "a", encoding="utf-8") as out_fh:
        for job in spec["jobs"]:
            t0 = time.perf_counter()
            row = {"cell": job["cell"]}
            try:
                press = getattr(kvpress, job["press"])(compression_ratio=float(job["compression_ratio"]))
                ctx = torch.tensor([job["context"]])
                glayers = job.get("global_layers") or list(range(model.config.num_hidden_layers))
                cache, first = prefill(ctx, press)
                row["stored_per_global_layer"] = stored(cache, glayers)
                row["context_tokens"] = ctx.shape[1]
                row["ratio"] = row["stored_per_global_layer"] / ctx.shape[1]
                all_layers = list(range(len(cache.layers)))
                row["ratio_all_layers"] = stored(cache, all_layers) / ctx.shape[1]
                if job["kind"] == "fidelity":
                    cont = torch.tensor([job["cont"]])
                    chunk = int(job.get("chunk", 64))
                    lp = cont_logprobs(cache, first, ctx.shape[1], cont, chunk)
                    key = json.dumps([job["context"][:8], len(job["context"]), job["cont"][:8], chunk])
                    if key not in refs:
                        rc, rf = prefill(ctx, None)
                        refs.clear()
                        refs[key] = cont_logprobs(rc, rf, ctx.shape[1], cont, chunk)
                    ref = refs[key]
                    kl = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)
                    t = cont.reshape(-1)
                    nll_r = -ref.gather(-1, t[:, None]).squeeze(-1)
                    nll = -lp.gather(-1, t[:, None]).squeeze(-1)
                    row.update(
                        kl_mean=float(kl.mean()),
                        kl_max=float(kl.max()),
                        top1_agree=float((ref.argmax(-1) == lp.argmax(-1)).float().mean()),
                        ppl_full=math.exp(float(nll_r.mean())),
                        ppl=math.exp(float(nll.mean())),
                    )
                    row["ppl_diff"] = row["ppl"] - row["ppl_full"]
                else:
                    q = torch.tensor([job["question"]])
                    out = feed(cache, q, ctx.shape[1])
                    nxt = int(out.logits[0, -1].argmax())
                    gen = [nxt]
                    pos = ctx.shape[1] + q.shape[1]
                    stop = set(job.get("stop", []))
                    for i in range(int(job.get("max_new", 12)) - 1):
                        if nxt in stop:
                            break
                        out = feed(cache, torch.tensor([[nxt]]), pos + i)
                        nxt = int(out.logits[0, -1].argmax())
                        gen.append(nxt)
                    row["generated"] = gen
            except Exception as exc:  # recorded per cell; the run goes on
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc()[-2000:]
            row["seconds"] = time.perf_counter() - t0
            out_fh.write(json.dumps(row) + "\n")
            out_fh.flush()
    return 0


def _patch_gemma3_rope(model) -> None:
    """ExpectedAttentionPress calls `rotary_emb(x, position_ids)` without the layer
    type, which Gemma3's multi-rope embedding needs (transformers 5.2 raises
    `'Gemma3RotaryEmbedding' object has no attribute 'None_inv_freq'`). A
    pre-hook on each attention module records its layer type; a missing
    `layer_type` falls back to it."""
    types = getattr(model.config, "layer_types", None)
    if not types:
        return
    current = {"type": types[0]}
    layers = getattr(getattr(model, "model", model), "layers", [])
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue

        def pre(module, args, kwargs, _t=types[i]):
            current["type"] = _t

        attn.register_forward_pre_hook(pre, with_kwargs=True)
    seen = set()
    for mod in model.modules():
        cls = type(mod)
        if cls.__name__.endswith("RotaryEmbedding") and cls not in seen and hasattr(mod, "layer_types"):
            seen.add(cls)
            orig = cls.forward

            def forward(self, x, position_ids, layer_type=None, _orig=orig):
                return _orig(self, x, position_ids, layer_type=layer_type or current["type"])

            cls.forward = forward


class _Out:
    def __init__(self, logits):
        self.logits = logits


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
