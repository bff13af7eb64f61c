"""Attention assembly: one attention over the parts a step attends.

The layer adds its parts in order (sinks | HCA entries | CSA entries | working set
| open block | window), each with an additive bias per key (padding and left-out
summaries -inf; `summary_bias` on fused entries); `attend` appends the new tokens
(causal among themselves) and an optional rest entry, writes keys, values and the
mask into reused buffers (`cache/scratch.py`) and runs SDPA once; a decode step whose
decoded keys and values would pass DECODE_KV_BYTES attends them in runs of keys instead,
merged by their log-sum-exp, so its buffers stay that size as the context grows.

Shapes: parts [b, h, n, d] (or int8 (codes, scale [b, h, n, 1]), decoded into place);
biases [b, h or 1, n]; queries [b, Hq, m, d] -> out [b, Hq, m, d].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from flashmem.cache import sdpa
from flashmem.cache.scratch import Scratch, thread_scratch, transient_cap
from flashmem.cache.working_set import Part
from flashmem.compress import page_code

NEG = float("-inf")
# The most one attention's mask may take: a chunk whose [b, Hq, m, L] mask is larger attends
# in slices of its queries (a 4096-token chunk over 4.7K selected keys: 600 MB at one layer).
# On a CPU at most scratch.CPU_TRANSIENT_BYTES (`transient_cap`).
MASK_BYTES = 64 << 20
# The most a decode step's decoded keys and values may take at once (both, in attention's
# dtype): a wider working set attends in runs of keys merged by their log-sum-exp
# (`Assembly._attend_in_runs`), so the step's buffers stay this size whatever the context.
# Each run costs a dozen operators more. On a CPU, where the buffers are the process's RAM,
# 4 MiB (SmolLM2 at 8K and 1/8: most layers in two runs, the widest in three, 1.1% of a step;
# docs/results.md, stop 65); on an accelerator, where a launch costs more than the bytes,
# 64 MiB (Llama-3.1-8B in bf16: a layer's 4-5K selected tokens at 128K and 1/16 in one run,
# 16K tokens a run at 1M).
DECODE_KV_BYTES = 4 << 20
DECODE_KV_BYTES_ACCELERATOR = 64 << 20
# On a CPU whose cold tier is off RAM (a disk tier: there the process's RAM is what the budget
# saves) the buffers, kept between steps (cache/scratch.py), are held to 1 MiB: 4 MiB of them
# were 0.09x of SmolLM2's 1/8 budget at 8K (45 MiB), for a few more runs a step
# (docs/results.md, stop 68).
DECODE_KV_BYTES_OFF_RAM = 1 << 20


def decode_kv_bytes(device: torch.device, cold_in_ram: bool = True) -> int:
    """DECODE_KV_BYTES on a CPU (DECODE_KV_BYTES_OFF_RAM where the cold tier is not in its RAM),
    DECODE_KV_BYTES_ACCELERATOR elsewhere."""
    if device.type != "cpu":
        return DECODE_KV_BYTES_ACCELERATOR
    return DECODE_KV_BYTES if cold_in_ram else min(DECODE_KV_BYTES, DECODE_KV_BYTES_OFF_RAM)


def step_scratch() -> Scratch:
    """The buffers a step's attention is assembled in: the thread's, reused. Under autograd
    (a forward outside torch.no_grad) fresh ones: a buffer written again by the next layer
    would change what backward reads."""
    return Scratch() if torch.is_grad_enabled() else thread_scratch()


class Assembly:
    """Keys, values and their biases, part by part, for one chunk's attention."""

    def __init__(self, b: int, hkv: int, dtype: torch.dtype, device: torch.device, kv_bytes: int | None = None) -> None:
        """kv_bytes: a decode step's bound on its decoded keys and values (`decode_kv_bytes`;
        None: the device's, with the cold tier in RAM)."""
        self.b, self.hkv, self.dtype, self.device = b, hkv, dtype, device
        self.kv_bytes = decode_kv_bytes(device) if kv_bytes is None else kv_bytes
        self.keys: list[Part] = []
        self.values: list[Part] = []
        self.biases: list[torch.Tensor] = []
        # bytes `attend` wrote into its K/V buffers and SDPA read back (traffic's device_copy_bytes)
        self.copied_bytes = 0
        # which part is the working set (`mark_working_set`): the rest entry subtracts its values
        self.working_set_part: int | None = None

    def add(self, k: Part, v: Part, bias: torch.Tensor) -> None:
        """A part k, v [b, h, n, d] with its bias [b, h or 1, n]; empty parts are skipped."""
        n = part_len(k)
        if n:
            self.keys.append(k)
            self.values.append(v)
            self.biases.append(bias.expand(self.b, self.hkv, n))

    def mark_working_set(self, k: Part, v: Part, bias: torch.Tensor) -> None:
        """`add` the working set's part, remembered: the rest entry's value is every sealed
        token's value sum less this part's, taken from the values as `attend` assembles them
        (int8 pages decoded once, for attention and the rest entry alike)."""
        at = len(self.values)
        self.add(k, v, bias)
        self.working_set_part = at if len(self.values) > at else None

    def add_valid(self, k: Part, v: Part, valid: torch.Tensor) -> None:
        """A part whose tokens are hidden where valid [b, n] is False (padding)."""
        self.add(k, v, bias_from_valid(valid, self.dtype))

    def attend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        valid_new: torch.Tensor,
        scaling: float,
        rest: RestEntry | None = None,
    ) -> torch.Tensor:
        """q [b, Hq, m, d] over the parts plus the chunk's own K/V [b, h, m, d] (causal,
        padding valid_new [b, m] hidden; each sees itself so no row is empty) and the rest
        entry (its value written last into the values, `RestEntry.value`) -> [b, Hq, m, d]."""
        b, hkv, m = self.b, self.hkv, q.shape[2]
        dev = k_new.device
        L = sum(bias.shape[-1] for bias in self.biases) + m + (rest is not None)
        if m == 1 and not torch.is_grad_enabled():
            run = self.kv_bytes // (2 * b * hkv * k_new.shape[-1] * k_new.element_size())
            if L > run:
                return self._attend_in_runs(q, k_new, v_new, scaling, rest, max(1, run))
        new_bias = None  # a decode step's one token sees itself, padded or not: bias 0, no mask built
        if m > 1:
            causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
            allowed = (causal[None] & valid_new[:, None, :]) | torch.eye(m, dtype=torch.bool, device=dev)[None]
            new_bias = torch.full((b, 1, m, m), NEG, dtype=q.dtype, device=dev).masked_fill_(allowed[:, None], 0.0)
        keys, values = [*self.keys, k_new], [*self.values, v_new]
        group = q.shape[1] // hkv
        scratch = step_scratch()
        if rest is not None:  # a zero key: its logit is all bias, per query head and query
            keys.append(k_new.new_zeros(b, hkv, 1, k_new.shape[-1]))
            values.append(v_new.new_zeros(b, hkv, 1, v_new.shape[-1]))  # its value: written below
        K = concat(keys, lambda shape: scratch.take("keys", shape, k_new.dtype, dev))
        V = concat(values, lambda shape: scratch.take("values", shape, v_new.dtype, dev))
        self.copied_bytes = copy_bytes(keys, K) + copy_bytes(values, V)
        if rest is not None:
            ws = None
            if self.working_set_part is not None:
                a = sum(part_len(p) for p in self.values[: self.working_set_part])
                ws = V[:, :, a : a + part_len(self.values[self.working_set_part])]
            V[:, :, -1:] = rest.value(ws).to(V.dtype)
            logit = rest.logit
        # The mask [b, Hq, rows, L] is written into a reused buffer laid out [b, h, group, rows, L]
        # (query head h * group + g, as enable_gqa pairs them): a prefill chunk's mask is 100+ MB
        # per layer, and a fresh one each time costs its page faults. Past MASK_BYTES the chunk's
        # queries attend in slices of rows, so the transient does not grow with the chunk.
        elem = torch.finfo(q.dtype).bits // 8
        rows = max(1, min(m, transient_cap(MASK_BYTES, dev) // max(1, b * hkv * group * L * elem)))
        mask = scratch.take("mask", (b, hkv, group, rows, L), q.dtype, dev)
        at = sum(bias.shape[-1] for bias in self.biases)
        if m == 1:
            # a decode step: the parts' biases, the token's own 0 (and a slot for the rest entry,
            # whose logit differs by query head: written below) in one op, then copied to the
            # group's other query heads (a write per part costs a launch each on a GPU, and its
            # dispatch on a CPU)
            torch.cat([*self.biases, mask.new_zeros(b, hkv, 1 + (rest is not None))], -1, out=mask[:, :, 0, 0])
            if group > 1:
                mask[:, :, 1:] = mask[:, :, :1]
        else:
            i = 0
            for bias in self.biases:  # [b, h, n]: one row for every query
                n = bias.shape[-1]
                mask[..., i : i + n] = bias[:, :, None, None, :]
                i += n
        outs = []
        for i0 in range(0, m, rows):
            i1 = min(m, i0 + rows)
            part = mask[..., : i1 - i0, :]
            if new_bias is not None:
                part[..., at : at + m] = new_bias[:, :, None, i0:i1]  # [b, 1, 1, rows, m]
            if rest is not None:
                part[..., -1] = logit.view(b, hkv, group, m)[..., i0:i1]
            outs.append(
                sdpa.attention(q[:, :, i0:i1], K, V, part.reshape(b, hkv * group, i1 - i0, L), scaling, group > 1)
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_in_runs(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        scaling: float,
        rest: RestEntry | None,
        run: int,
    ) -> torch.Tensor:
        """`attend` for a decode step, its keys in runs of at most `run` tokens: each run's
        parts (sliced where one spans two runs) written into the reused buffers, attended by each
        KV head's group of query heads with its log-sum-exp (`sdpa.attention_lse`), the runs
        and the rest entry then merged by those. The same attention within float tolerance;
        the working set's values the rest entry subtracts are summed run by run.
        q [b, Hq, 1, d]; k_new, v_new [b, h, 1, d] -> [b, Hq, 1, d]."""
        b, hkv, dev = self.b, self.hkv, k_new.device
        hq, d = q.shape[1], q.shape[-1]
        qg = q.reshape(b, hkv, hq // hkv, d)  # query head h * group + g reads KV head h
        keys, values = [*self.keys, k_new], [*self.values, v_new]
        biases = [*self.biases, k_new.new_zeros(b, hkv, 1)]  # the token sees itself
        scratch = step_scratch()
        outs, lses = [], []
        # [b, h, 1, d] fp32: the working set's values, weighted, as attention reads them
        ws_sum: torch.Tensor | None = None
        self.copied_bytes = 0
        for pieces in runs([part_len(p) for p in keys], run):
            ks = [slice_part(keys[i], a, e) for i, a, e in pieces]
            vs = [slice_part(values[i], a, e) for i, a, e in pieces]
            K = concat(ks, lambda shape: scratch.take("keys", shape, k_new.dtype, dev))
            V = concat(vs, lambda shape: scratch.take("values", shape, v_new.dtype, dev))
            self.copied_bytes += copy_bytes(ks, K) + copy_bytes(vs, V)
            bias = [biases[i][..., a:e] for i, a, e in pieces]
            out, lse = sdpa.attention_lse(qg, K, V, bias[0] if len(bias) == 1 else torch.cat(bias, -1), scaling)
            outs.append(out)
            lses.append(lse)
            at = 0
            for i, a, e in pieces:
                if rest is not None and rest.ws_weight is not None and i == self.working_set_part:
                    part = torch.matmul(rest.ws_weight[:, :, None, a:e], V[:, :, at : at + e - a].float())
                    ws_sum = part if ws_sum is None else ws_sum.add_(part)
                at += e - a
        if rest is not None:  # its key is zero: the logit is all bias, and the value is the entry's
            outs.append(rest.mean(ws_sum).expand(b, hkv, hq // hkv, d))
            lses.append(rest.logit.view(b, hkv, hq // hkv))
        weights = torch.softmax(torch.stack(lses), dim=0)  # [runs, b, h, group]: each run's mass
        out = torch.sum(torch.stack(outs).mul_(weights[..., None]), dim=0)
        return out.view(b, hq, 1, d).to(q.dtype)


def runs(lengths: list[int], run: int) -> list[list[tuple[int, int, int]]]:
    """Parts of these lengths, in order, cut into runs of at most `run` tokens: per run its
    pieces (part, start, end); a part that does not fit where its run has room goes on in the next."""
    out: list[list[tuple[int, int, int]]] = [[]]
    room = run
    for i, n in enumerate(lengths):
        a = 0
        while a < n:
            if room == 0:
                out.append([])
                room = run
            e = min(n, a + room)
            out[-1].append((i, a, e))
            room -= e - a
            a = e
    return out


def slice_part(p: Part, a: int, e: int) -> Part:
    """Tokens a:e of a part [b, h, n, d] (of an int8 part, its codes and scales alike)."""
    if isinstance(p, tuple):
        return p[0][:, :, a:e], p[1][:, :, a:e]
    return p[:, :, a:e]


def part_len(p: Part) -> int:
    return (p[0] if isinstance(p, tuple) else p).shape[-2]


def bias_from_valid(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[b, L] validity -> [b, 1, L] additive bias (0 or -inf)."""
    return torch.full(valid.shape, NEG, dtype=dtype, device=valid.device).masked_fill_(valid, 0.0)[:, None]


def copy_bytes(parts: list[Part], out: torch.Tensor) -> int:
    """Bytes `concat` moved beyond reading its parts: the buffer `out` written and read back by
    attention (nothing when one part was handed over as is), and, where int8 parts are decoded
    in two passes (a CPU), their decoded bytes read and written once more."""
    if len(parts) == 1 and isinstance(parts[0], torch.Tensor):
        return 0
    moved = 2 * out.nbytes
    if not one_pass_decode(out.device):
        moved += sum(2 * part_len(p) * out.shape[0] * out.shape[1] * out.shape[-1] * out.element_size()
                     for p in parts if isinstance(p, tuple))  # fmt: skip
    return moved


def one_pass_decode(device: torch.device) -> bool:
    """An int8 part is decoded into attention's buffer by one mixed-dtype multiply on an
    accelerator (one kernel: the decoded bytes written once, as the hardware model charges,
    sizing/hardware.py `assembly_bytes`), by a copy and an in-place scale on a CPU (faster there)."""
    return device.type != "cpu"


def concat(parts: list[Part], buffer: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """Attention's keys or values: parts [b, h, n_i, d] -> [b, h, sum n_i, d], written into
    `buffer(shape)` (a reused scratch buffer). An int8 part (codes, scale [b, h, n, 1]) is
    decoded into its place in the same pass, not decoded and then copied."""
    if len(parts) == 1 and isinstance(parts[0], torch.Tensor):
        return parts[0]
    if torch.is_grad_enabled():  # autograd refuses out= writes: decode, then concatenate
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        return torch.cat([p if isinstance(p, torch.Tensor) else page_code.decode(p[0], p[1], dtype) for p in parts], -2)
    lead = parts[0][0] if isinstance(parts[0], tuple) else parts[0]
    b, h, _, d = lead.shape
    out = buffer((b, h, sum(part_len(p) for p in parts), d))
    at = 0
    for p in parts:
        n = part_len(p)
        if isinstance(p, tuple):
            dst = out[:, :, at : at + n]
            if one_pass_decode(dst.device):  # codes and scales read, the buffer written: once
                torch.mul(p[0], p[1], out=dst)
            else:
                # int8 codes are exact in fp32 and bf16; on a CPU a copy then an in-place multiply
                # is about 2x torch.mul(codes, scale, out=), whose mixed-dtype loop does not vectorise
                dst.copy_(p[0]).mul_(p[1])
        else:
            out[:, :, at : at + n] = p
        at += n
    return out


def entry_bias(counts: torch.Tensor, use: torch.Tensor, rule: str, dtype: torch.dtype) -> torch.Tensor:
    """Additive logit bias of fused entries. counts: [b, n]; use: [b, h, n] or [n] -> [b, h, n].

    `log_size` gives an entry standing for s tokens log(s) extra logit (proportional
    attention, as in token merging), so it can carry the mass of the tokens it replaces.
    """
    c = counts[:, None, :].to(torch.float32)
    bias = c.clamp_min(1).log() if rule == "log_size" else torch.zeros_like(c)
    keep = use & (counts[:, None, :] > 0)
    return bias.masked_fill(~keep, NEG).to(dtype)


@dataclass
class RestEntry:
    """The rest entry of one chunk: its logit [b, Hq, m], and what its value needs: every
    sealed token's value sum v_sum [b, h, d] (fp32), the left-out tokens' count n_left [b, h]
    and the working set's token weights ws_weight [b, h, n] (1 valid, 0 padding; None: no
    working set). The value is taken once the working set's values are assembled (`value`)."""

    logit: torch.Tensor
    v_sum: torch.Tensor
    n_left: torch.Tensor
    ws_weight: torch.Tensor | None

    def value(self, ws_values: torch.Tensor | None) -> torch.Tensor:
        """The left-out tokens' mean value [b, h, 1, d] (fp32): v_sum less the working set's
        values ws_values [b, h, n, d] as attention reads them (one weighted sum, a GEMV per
        head)."""
        ws_sum = None
        if self.ws_weight is not None and ws_values is not None:
            vals = ws_values if ws_values.dtype == torch.float32 else ws_values.float()
            ws_sum = torch.matmul(self.ws_weight[:, :, None, :], vals)
        return self.mean(ws_sum)

    def mean(self, ws_sum: torch.Tensor | None) -> torch.Tensor:
        """The left-out tokens' mean value [b, h, 1, d] (fp32), given the working set's weighted
        value sum ws_sum [b, h, 1, d] (None: no working set)."""
        v_sum = self.v_sum[:, :, None, :]
        if ws_sum is not None:
            v_sum = v_sum - ws_sum
        return v_sum / self.n_left.clamp_min(1)[..., None, None]


def rest_entry(
    scores: Iterable[torch.Tensor],
    selected: torch.Tensor,
    page_tokens_valid: torch.Tensor,
    v_sum: torch.Tensor,
    ws_valid: torch.Tensor | None,
    scaling: float,
    m: int,
) -> RestEntry:
    """One entry per KV head standing for every sealed token not attended exactly,
    so the softmax keeps the mass the left-out history had (without it, attention
    renormalises over a few pages and the output leaves the model's range).

    Logit, per query: log sum over left-out pages of n_page * exp(s q . index key);
    value: the mean value of the left-out tokens (running sum v_sum [b, h, d] minus the
    working set's, whose validity is ws_valid [b, h, n]: `RestEntry.value`). scores: the
    index's scores [b, h, m*group, pages] in blocks of query rows, in order (one block, or
    several where a prompt chunk's would pass their bound); selected: [b, h, pages];
    page_tokens_valid: [b, pages, P] -> the entry (logit [b, Hq, m]).
    """
    b, h = selected.shape[:2]
    counts = page_tokens_valid.sum(-1, dtype=torch.float32)  # [b, pages]
    attended = selected | (counts == 0)[:, None, :]  # not left out: selected, or no token
    logits = []
    for block in scores:
        lg = block.float() * scaling  # a fresh tensor: the rest in place
        lg.add_(counts.clamp_min(1).log()[:, None, None, :]).masked_fill_(attended[:, :, None, :], NEG)
        logits.append(torch.logsumexp(lg, dim=-1))  # [b, h, rows]
        del lg
    logit = logits[0] if len(logits) == 1 else torch.cat(logits, dim=-1)  # [b, h, nq]
    group = logit.shape[-1] // m
    logit = logit.view(b, h, m, group).transpose(2, 3).reshape(b, h * group, m)
    n_left = counts.sum(-1)[:, None].expand(b, h)
    w = None
    if ws_valid is not None:
        w = ws_valid.to(torch.float32)
        n_left = n_left - w.sum(-1)
    return RestEntry(logit, v_sum, n_left, w)
