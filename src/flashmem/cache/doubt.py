"""Exact on doubt (`exact_on_doubt`): a decode step whose next token is a near tie is run again exactly.

A selecting step's attention is close to the full cache's, not equal to it. Where the model's
top two next tokens are nearly tied, that small difference can pick the other one, and the
answer then goes its own way: on issue 31's multi-piece tasks most items flashmem lost were
ones the full cache itself found by a margin below 0.1 nats (docs/results.md, stops 56-57 and
60). With `exact_on_doubt` m > 0, after every one-token forward the gap between the top two
logits of each row is read. Where any row's gap is below m, the step is undone and run again
exactly, and the forward returns that run: the logits the full cache gives for the same tokens.

Exactly means every managed layer attends every earlier token, read back from the tiers as the
streamed exact prompt does (`exact_prompt.attend_streamed`), and also that the K/V it attends
are the full cache's. The prompt's are (it is attended exactly), but a generated token's K/V at
layer l were computed from its selecting attention below l. So the redo runs again every token
generated since the last exact point (the prompt's end, or the last redo), at most
REDO_MAX_TOKENS, as one chunk: those tokens are cropped out of every layer and fed again. Past
REDO_MAX_TOKENS the exact point moves on, and the older generated tokens keep their K/V.

Undoing: a FlashLayer drops the tokens as a crop does (`generation.crop`: a block they sealed is
unsealed from the exact cold tier); a plain full layer is cropped; a sliding-window layer, which
cannot be cropped once its window is full, gets back its window at the exact point, rebuilt from
the live one and the tokens that left it since (saved at the point). What the first run
changed in a layer's working set stays: it is a cache of pages, not part of the attention.

Memory: a sliding-window layer keeps a copy of its window's oldest REDO_MAX_TOKENS tokens at
the point, the most that can leave the window before a redo goes back to it; the rest of the
window at the point is still in the live one (`memory_report()["doubt_held_bytes"]` counts the
copies, in `device_resident_bytes` too: Gemma3-270m's 512-token windows, an eighth more).
FlashLayers and full layers keep nothing more: they are cropped.

Cost: a redone step runs the model once more, over the tokens since the exact point, and reads
the whole cold tier once per layer in runs of about one prefill chunk (counted in
`traffic_report()` as a redo forward: `steps.redo_forwards`, `per_redo_forward_median`); the
device holds the budget plus one run, as during the prompt. `memory_report()["doubt_steps"]`
and `["doubt_redone"]` count the one-token forwards checked and redone,
`["doubt_redone_tokens"]` the tokens fed again, `["doubt_changed"]` the redone steps whose next
token (greedy, in some row) the redo changed. The cost is capped: after n checked steps at most
FREE_REDOS + `exact_on_doubt_share` x n have been redone, and a near tie past that stays as
selected (`["doubt_capped"]`). A model whose every step is a near tie (random weights give flat
logits) then pays for one redo in 8 steps, not every step. With `exact_on_doubt_min_mass` m, a
near tie whose two tokens hold less than m of the probability together (a flat distribution,
where neither is the model's answer) is not redone either (`["doubt_flat"]`).

Installed on the model by `flashmem.attach` when the config asks for it, as a forward pre-hook
and hook on the model's top module. They act only for a FlashMemoryCache whose config has
`exact_on_doubt` > 0, on forwards given `input_ids` and a 2-D attention mask (or none), and
check one-token forwards that return logits. A forward of several tokens attended exactly (the
prompt) is an exact point when it ends; one that selected (a verify forward, a prompt past
`prefill_exact_tokens`) leaves none, and the next one-token forward starts one, the K/V before
it as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from flashmem.cache import generation
from flashmem.cache.flash_layer import FlashLayer

_INSTALLED = "_flashmem_doubt_hooks"
REDO_MAX_TOKENS = 64  # generated tokens a redo feeds again at most (one chunk of a few pages)
# Redos allowed before `exact_on_doubt_share` binds: after n checked steps at most
# FREE_REDOS + share x n have been redone. The measured prompts redid at most 11 of 39 steps and
# 9 of 23 (docs/results.md, "A cap on the redone steps"), so 8 plus 1/8 of the steps covers an
# answer's near ties, while a model whose every step is one (random weights) is redone on 1 step in 8.
FREE_REDOS = 8


@dataclass
class DoubtState:
    """A cache's bookkeeping since its last exact point."""

    counts: dict[str, int] = field(
        default_factory=lambda: {"steps": 0, "redone": 0, "redone_tokens": 0, "capped": 0, "changed": 0, "flat": 0}
    )
    ids: list[torch.Tensor] | None = None  # the one-token inputs [b, 1] since the point; None: no point
    sliding: dict[int, dict[str, Any]] = field(default_factory=dict)  # sliding layers' state at the point
    checking: bool = False  # the forward in flight is a one-token step to check
    ends_point: bool = False  # the forward in flight ends at an exact point (several tokens)

    def mark_point(self, cache: Any) -> None:
        """Every K/V the cache holds now is the full cache's: redo from here."""
        self.ids = []
        self.sliding = {
            i: _sliding_point(layer)
            for i, layer in enumerate(cache.layers)
            if isinstance(layer, DynamicSlidingWindowLayer)
        }

    def may_redo(self, share: float) -> bool:
        """Whether one more redo stays within FREE_REDOS + share x the steps checked so far."""
        return self.counts["redone"] + 1 <= FREE_REDOS + share * self.counts["steps"] + 1e-9

    def held_bytes(self, cache: Any) -> int:
        """Bytes of the sliding layers' saved state that the live layers do not share."""
        live = {
            t.data_ptr()
            for layer in cache.layers
            if isinstance(layer, DynamicSlidingWindowLayer)
            for t in vars(layer).values()
            if isinstance(t, torch.Tensor)
        }
        saved = [t for state in self.sliding.values() for t in [*state.values(), *state.get(_HEAD, ())]]
        return sum(
            t.numel() * t.element_size() for t in saved if isinstance(t, torch.Tensor) and t.data_ptr() not in live
        )


_HEAD = "_doubt_head"  # a sliding layer's oldest tokens at the point: (keys, values, window length)


def _sliding_point(layer: DynamicSlidingWindowLayer) -> dict[str, Any]:
    """A sliding layer's state at the exact point. The redo goes back to the point from at most
    REDO_MAX_TOKENS tokens later, and by then at most that many of the window's oldest tokens
    have left it, so those are copied (`_HEAD`) and the rest is rebuilt from the live window
    (`_restore_sliding`); a layer that records its past (assisted decoding) or has no window
    yet is kept whole, by reference."""
    state = dict(vars(layer))
    keys, values = state.get("keys"), state.get("values")
    if (
        getattr(layer, "record_past", False)
        or not isinstance(keys, torch.Tensor)
        or not isinstance(values, torch.Tensor)
    ):
        return state
    n = min(REDO_MAX_TOKENS, keys.shape[-2])
    state.pop("keys"), state.pop("values")
    state[_HEAD] = (keys[:, :, :n].clone(), values[:, :, :n].clone(), keys.shape[-2])  # [b, h, n, d] each
    return state


def _restore_sliding(layer: DynamicSlidingWindowLayer, state: dict[str, Any], n: int) -> None:
    """Take the last n tokens (all of them since the point) back out of a sliding layer: its
    window at the point is the tokens that left since (the saved head's first ones) followed by
    the live window's tokens that were already in it."""
    head = state.get(_HEAD)
    rest = {k: v for k, v in state.items() if k != _HEAD}
    if head is None:
        vars(layer).clear()
        vars(layer).update(rest)
        return
    k0, v0, length = head
    live_k, live_v = layer.keys, layer.values
    assert live_k is not None and live_v is not None  # initialized at the point, so still
    keep = max(0, live_k.shape[-2] - n)  # the live window's tokens from before the point
    left = length - keep  # ... and those that left it since, at most n <= REDO_MAX_TOKENS
    assert left <= k0.shape[-2], "a redo goes back at most REDO_MAX_TOKENS tokens"
    keys = torch.cat([k0[:, :, :left], live_k[:, :, :keep]], dim=-2)
    values = torch.cat([v0[:, :, :left], live_v[:, :, :keep]], dim=-2)
    vars(layer).clear()
    vars(layer).update(rest)
    layer.keys, layer.values = keys, values


def install(model: torch.nn.Module) -> None:
    """Put the two hooks on `model` (once; they do nothing for other caches)."""
    if getattr(model, _INSTALLED, False):
        return
    model.register_forward_pre_hook(_before, with_kwargs=True)
    model.register_forward_hook(_after, with_kwargs=True)
    setattr(model, _INSTALLED, True)


def top_gap(logits: torch.Tensor) -> torch.Tensor:
    """logits [b, V] -> [b]: the top logit minus the runner-up's (nats; 0 for a tie)."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def top_two_mass(logits: torch.Tensor) -> torch.Tensor:
    """logits [b, V] -> [b]: the probability the top two tokens hold together."""
    return logits.float().softmax(-1).topk(2, dim=-1).values.sum(-1)


def _cache_of(kwargs: dict[str, Any]) -> Any:
    from flashmem.cache.flash_cache import FlashMemoryCache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, FlashMemoryCache) and cache.cfg.exact_on_doubt > 0:
        return cache
    return None


def _input_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    x = kwargs.get("input_ids", args[0] if args else None)
    return x if isinstance(x, torch.Tensor) and x.dim() == 2 else None


def _before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    cache = _cache_of(kwargs)
    if cache is None:
        return
    st: DoubtState = cache.doubt
    ids = _input_ids(args, kwargs)
    mask = kwargs.get("attention_mask")
    st.checking = st.ends_point = False
    if ids is None or len(args) > 1 or (mask is not None and mask.dim() != 2):  # a redo could not repeat it
        st.ids = None
        return
    if ids.shape[1] > 1:
        st.ends_point = True
        return
    if cache.get_seq_length() == 0:
        return
    if st.ids is None or len(st.ids) >= REDO_MAX_TOKENS:
        st.mark_point(cache)  # the point moves on: the older generated tokens keep their K/V
    assert st.ids is not None
    st.ids.append(ids)
    st.checking = True


def _after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    cache = _cache_of(kwargs)
    if cache is None:
        return None
    st: DoubtState = cache.doubt
    if st.ends_point:  # a prompt attended exactly is a point; a verify forward selected: no point
        st.ends_point = False
        if all(layer.forward_exact for layer in cache.flash_layers if layer.is_initialized):
            st.mark_point(cache)
        else:
            st.ids = None
        return None
    logits = getattr(output, "logits", None)
    if not st.checking or logits is None or logits.dim() != 3:
        return None
    st.checking = False
    st.counts["steps"] += 1
    tied = top_gap(logits[:, -1]) < cache.cfg.exact_on_doubt  # [b]
    if not bool(tied.any()):
        return None
    floor = cache.cfg.exact_on_doubt_min_mass
    if floor > 0 and not bool((tied & (top_two_mass(logits[:, -1]) >= floor)).any()):
        st.counts["flat"] += 1  # a near tie in a flat distribution: left as selected
        return None
    if not st.may_redo(cache.cfg.exact_on_doubt_share):  # the cap: this near tie stays as selected
        st.counts["capped"] += 1
        return None
    assert st.ids is not None
    redo = torch.cat(st.ids, dim=1)  # [b, n]: the tokens since the exact point, this one last
    n = redo.shape[1]
    if not _undo(cache, st, n):
        return None
    flash = cache.flash_layers
    for layer in flash:
        layer.exact_redo = True
    chosen = logits[:, -1].argmax(-1)  # [b]: the selecting run's next tokens
    cache.traffic.expect_redo()  # counted apart from decode steps and prompt forwards
    try:  # forward, not __call__: these hooks stay out of it
        redone = module.forward(**_repeat_kwargs(args, kwargs, redo))
    finally:
        for layer in flash:
            layer.exact_redo = False
    st.counts["redone"] += 1
    st.counts["redone_tokens"] += n
    # a redo that picks another next token for some row: what the redos change, not only cost
    st.counts["changed"] += int(bool((redone.logits[:, -1].argmax(-1) != chosen).any()))
    st.mark_point(cache)
    return redone


def _repeat_kwargs(args: tuple[Any, ...], kwargs: dict[str, Any], redo: torch.Tensor) -> dict[str, Any]:
    """The forward's arguments for the n tokens `redo` [b, n] ending at its one token: the same
    mask (it spans every position), the n positions before and at its own, its last logits only."""
    out = dict(kwargs)  # input_ids, if it came first by position, is replaced below
    n = redo.shape[1]
    out["input_ids"] = redo
    back = torch.arange(n - 1, -1, -1, device=redo.device)  # n-1 .. 0
    for key in ("position_ids", "cache_position"):
        pos = out.get(key)
        if isinstance(pos, torch.Tensor):
            out[key] = pos[..., -1:] - back
    out["logits_to_keep"] = 1  # the step's logits only, as the one-token forward returned
    return out


def _undo(cache: Any, st: DoubtState, n: int) -> bool:
    """Take the last n tokens back out of every layer (False: a layer cannot, nothing changed)."""
    flash = [layer for layer in cache.layers if isinstance(layer, FlashLayer) and layer.is_initialized]
    if any(generation.croppable_tokens(layer) < n for layer in flash):
        return False  # rows changed since blocks sealed (beam search): they cannot be unsealed
    unsealed = {id(layer): generation.read_unsealed(layer, n) for layer in flash}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, FlashLayer):
            if layer.is_initialized:
                generation.crop(layer, -n, unsealed[id(layer)])
        elif isinstance(layer, DynamicSlidingWindowLayer):
            _restore_sliding(layer, st.sliding[i], n)
        elif isinstance(layer, DynamicLayer):
            layer.crop(-n)
    return True
