"""How much of a model's keys and values a low-rank code keeps, per rank, and the error of
each fit of the cold tier's code (PCA, logit-weighted) (docs/measurements.md, "Low-rank cold tier").

Bases are fitted on 2,048 tokens of the calibration text (pydoc) and measured on
2,048 tokens of the fidelity suite's text (KJV) and on the calibration text itself,
all managed layers and KV heads, the first 4 tokens (sinks) left out:

- reconstruction error ||x - x_hat||^2 / ||x||^2 of pre-RoPE keys (what
  `cold_low_rank` codes), post-RoPE keys (a basis fitted the same way after RoPE) and
  values, plain PCA;
- the error that matters: keys' expected logit error E[(q.(k - k_hat))^2] / E[(q.k)^2]
  (pre-RoPE q and k) and values' output error E[|W_o (v - v_hat)|^2] / E[|W_o v|^2],
  for PCA and for the fit weighted by it (`calibration.fit.logit_weighted_basis`).

    python benchmarks/diagnostics/lowrank_residual.py --model smollm2 --json results/lowrank_residual_smollm2.json
"""

from __future__ import annotations

import argparse
import json

import torch

import flashmem
from flashmem.calibration.capture import capture_qk
from flashmem.calibration.fit import logit_weighted_basis, second_moment_basis
from flashmem.calibration.texts import calibration_text
from flashmem.models import geometry
from flashmem.rope import find_rotator
from flashmem.texts import haystack

SKIP = 4


def moment(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x.T @ x / x.shape[0]


def rel(x: torch.Tensor, enc: torch.Tensor, dec: torch.Tensor, r: int, w: torch.Tensor | None = None) -> float:
    """Relative error of coding x [N, d] with the top-r rows of enc / dec, plain or
    weighted by w [d, d] (tr(w E[e e^T]) / tr(w E[x x^T]))."""
    err = x - (x @ enc[:r].T) @ dec[:r]
    if w is None:
        return float(err.square().sum() / x.square().sum())
    return float(torch.trace(w @ moment(err)) / torch.trace(w @ moment(x)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ranks", default="16,32,48")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m, tok = flashmem.load_model(a.model)
    cfg = m.config.get_text_config(decoder=True)
    n_layers = cfg.num_hidden_layers
    kinds = geometry.layer_types(cfg, n_layers, infer_sliding=False)
    layers = [i for i, k in enumerate(kinds) if k not in ("sliding_attention", "chunked_attention")]
    T = a.tokens
    body, _ = calibration_text("pydoc")
    fit_ids = [tok.bos_token_id] + tok(body[: 12 * T], add_special_tokens=False)["input_ids"][: T - 1]
    eval_ids = tok(haystack(tok, T + 64, seed=0), add_special_tokens=True)["input_ids"][:T]

    def capture(ids: list[int]):
        with capture_qk(m, set(layers)) as c, torch.no_grad():
            m(input_ids=torch.tensor([ids]), use_cache=False)
        return c

    cf, ce = capture(fit_ids), capture(eval_ids)
    pos = torch.arange(T)
    ranks = [int(r) for r in a.ranks.split(",")]
    acc: dict[int, dict[str, list[float]]] = {r: {} for r in ranks}

    def add(r: int, name: str, v: float) -> None:
        acc[r].setdefault(name, []).append(v)

    for i in layers:
        d = cf.keys[i][0].shape[-1]
        rot = find_rotator(m, kinds[i], d)
        assert rot is not None, f"layer {i}: no RoPE found"
        hkv = cf.keys[i][0].shape[0]
        group = cf.queries[i][0].shape[0] // hkv
        wo = m.model.layers[i].self_attn.o_proj.weight.detach().double()  # [hidden, Hq * d]
        for h in range(hkv):
            heads = range(h * group, (h + 1) * group)
            x = {}  # (part, text) -> [N, d] float64, sinks left out
            for text, c in (("fit", cf), ("eval", ce)):
                x["k_pre", text] = rot.unrotate(c.keys[i][0][h], pos)[SKIP:].double()
                x["k_post", text] = c.keys[i][0][h][SKIP:].double()
                x["v", text] = c.values[i][0][h][SKIP:].double()
                x["q_pre", text] = torch.cat([rot.unrotate(c.queries[i][0][g], pos)[SKIP:] for g in heads]).double()
            co = sum(wo[:, g * d : (g + 1) * d].T @ wo[:, g * d : (g + 1) * d] for g in heads)
            pca = {p: second_moment_basis(x[p, "fit"].float())[0].double() for p in ("k_pre", "k_post", "v")}
            enc, dec = (t.double() for t in logit_weighted_basis(x["k_pre", "fit"].float(), x["q_pre", "fit"].float()))
            # the value fit weighted by the output projection: same algebra, W = sum W_o^T W_o
            ev, vec = torch.linalg.eigh(co)
            ev = ev.clamp_min(float(ev.max()) * 1e-6)
            s_half, s_inv = vec @ torch.diag(ev.sqrt()) @ vec.T, vec @ torch.diag(ev.rsqrt()) @ vec.T
            _, vv = torch.linalg.eigh(s_half @ moment(x["v", "fit"]) @ s_half)
            vv = vv.flip(-1)
            v_enc, v_dec = vv.T @ s_half, (s_inv @ vv).T
            q_eval = moment(x["q_pre", "eval"])
            for r in ranks:
                for text in ("eval", "fit"):
                    add(r, f"recon_k_pre_{text}", rel(x["k_pre", text], pca["k_pre"], pca["k_pre"], r))
                    add(r, f"recon_v_{text}", rel(x["v", text], pca["v"], pca["v"], r))
                add(r, "recon_k_post_eval", rel(x["k_post", "eval"], pca["k_post"], pca["k_post"], r))
                add(r, "logit_err_k_pca_eval", rel(x["k_pre", "eval"], pca["k_pre"], pca["k_pre"], r, q_eval))
                add(r, "logit_err_k_weighted_eval", rel(x["k_pre", "eval"], enc, dec, r, q_eval))
                add(r, "out_err_v_pca_eval", rel(x["v", "eval"], pca["v"], pca["v"], r, co))
                add(r, "out_err_v_weighted_eval", rel(x["v", "eval"], v_enc, v_dec, r, co))
    out = {str(r): {k: round(sum(v) / len(v), 4) for k, v in d_.items()} for r, d_ in acc.items()}
    meta = {"model": a.model, "tokens": T, "fit_text": "pydoc", "eval_text": "kjv (flashmem.texts.haystack seed 0)"}
    print(json.dumps({"meta": meta, "mean_over_layers_and_heads": out}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "mean_over_layers_and_heads": out}, f, indent=1)


if __name__ == "__main__":
    main()
