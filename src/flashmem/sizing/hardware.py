"""A hardware model: decode-step time, prefill time and the largest batch on an accelerator.

Every number here is *modelled, not measured*: it is arithmetic on documented
bandwidth and capacity constants (vendor datasheets, as listed in
docs/accelerator.md) and on the bytes a step moves. `flashmem estimate --hardware`
prints it; `benchmarks/gpu_check.py` prints it beside CUDA measurements.

Three ways to hold the KV cache are modelled, one sequence of `tokens` tokens each,
`batch` sequences:

* **full** - the whole cache in HBM (an ideal paged/static cache: each decode step
  reads the weights once and every sequence's K/V once).
* **offloaded** - the whole cache in host memory, streamed to the device layer by
  layer every step (transformers' `DynamicCache(offloading=True)`: layer l+1 is
  prefetched on a side stream while layer l computes; two layers are resident).
* **flashmem** - the device-resident tiers of a `FlashMemoryConfig` (from
  `flashmem.sizing.calculator`) in HBM, the cold tier on the host; per step the
  device reads the weights and the resident tiers, and the link carries the pages
  that newly enter the working set (predicted: `new_page_fraction` of the selected
  pages; or counted: a run's `cache.traffic_report()`), plus, when the config
  re-ranks candidates by their exact keys and those keys live in the cold tier,
  the candidates' keys (exact, or as `lsa_rerank_codec`'s codes), and the host's FLOPs
  to score them when they are ranked on the host. With `lsa_rerank_on_device` the
  candidates' codes are held on the device (in the resident bytes, as the calculator
  counts them) and scored there: the link carries only the codes of candidates that are
  new this step (`new_candidate_fraction`), the host reads and computes nothing.

Step time is a roofline: each resource's time is bytes / bandwidth (FLOPs / (a
fraction of peak) for the device's compute, FLOPs / the host's rate for the host's); with `overlap` (prefetch on a copy stream) the step
takes the slowest of them, without it their sum. Prefill is compute-bound:
2 x params x tokens + causal attention FLOPs, at `flops_fraction` of peak, or the
link's time for the bytes a prompt moves, if that is longer. Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flashmem.errors import ConfigError

GB = 10**9
GiB = 2**30
MiB = 2**20


# Host compute (the re-rank's scores when candidates are ranked on the host): a dual-socket
# server CPU as in NVIDIA's DGX H100/H200 datasheet, 2 x Intel Xeon Platinum 8480C (56 cores
# each, 2.0 GHz base). Peak fp32: 112 cores x 2 AVX-512 FMA units x 16 lanes x 2 FLOPs x
# 2.0 GHz = 14.3 TFLOP/s. The score is a skinny product (one decode query per head: a GQA
# group of 4 rows against thousands of keys), which reaches about a tenth of a core's GEMM
# rate: 0.10-0.12 measured on this project's CPU, one thread
# (`OMP_NUM_THREADS=1 python benchmarks/host_score_rate.py`, results/host_score_rate.json).
# So 1.43 TFLOP/s; `--host-tflops` overrides it. The same host is assumed for every device.
HOST_PEAK_FLOPS = 2 * 56 * 2 * 16 * 2 * 2.0e9
HOST_FLOPS_FRACTION = 0.1
HOST_FLOPS = HOST_PEAK_FLOPS * HOST_FLOPS_FRACTION


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its host, as rates in bytes/s and FLOP/s and a capacity in bytes."""

    key: str
    name: str
    hbm_bytes: int  # device memory, as nvidia-smi reports the total
    hbm_bytes_per_s: float  # device memory bandwidth (datasheet)
    link_bytes_per_s: float  # host to device, pinned buffers, as measured (not nominal)
    nvme_bytes_per_s: float  # one NVMe SSD, sequential read
    host_bytes_per_s: float  # host DRAM read, one socket (for compute on the host)
    peak_flops: float  # dense bf16 tensor-core FLOP/s (datasheet, no sparsity)
    source: str
    host_flops: float = HOST_FLOPS  # FLOP/s the host reaches scoring re-rank candidates (not its peak)


# Sources (docs/accelerator.md has the table): memory totals are nvidia-smi's MiB
# (H100 81559, A100 80GB 81920, L4 23034 as listed in modal-labs/modal-client PR #2797;
# H200 143771 as seen on this project's lent H200, .library/device/KINDS.md). Bandwidths
# and TFLOPS are the vendors' datasheets (H100/H200 SXM: 3.35 / 4.8 TB/s, 989 TFLOPS dense
# bf16; A100 80GB SXM: 2.039 TB/s, 312 TFLOPS; L4: 300 GB/s GDDR6, 121 TFLOPS). The host
# link is the measured-with-pinned-buffers figure of shared/ACCELERATOR.md: PCIe Gen5 x16
# ~55 GB/s (H100/H200), Gen4 x16 ~25 GB/s (A100/L4). NVMe: Gen5 ~13 GB/s, Gen4 ~7 GB/s.
# Host DRAM: 200 GB/s, the middle of ACCELERATOR.md's 100-300 GB/s per socket.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", "NVIDIA H100 SXM (HBM3)", 81559 * MiB, 3.35e12, 55e9, 13e9, 200e9, 989e12,
        "HBM 3.35 TB/s, 989 TFLOPS bf16 (datasheet); 81559 MiB (nvidia-smi); PCIe Gen5 ~55 GB/s H2D measured",
    ),
    "h200": Hardware(
        "h200", "NVIDIA H200 SXM (HBM3e)", 143771 * MiB, 4.8e12, 55e9, 13e9, 200e9, 989e12,
        "HBM 4.8 TB/s, 989 TFLOPS bf16 (datasheet); 143771 MiB (nvidia-smi); PCIe Gen5 ~55 GB/s H2D measured",
    ),
    "a100": Hardware(
        "a100", "NVIDIA A100 80GB SXM (HBM2e)", 81920 * MiB, 2.039e12, 25e9, 7e9, 200e9, 312e12,
        "HBM 2.039 TB/s, 312 TFLOPS bf16 (datasheet); 81920 MiB (nvidia-smi); PCIe Gen4 ~25 GB/s H2D measured",
    ),
    "l4": Hardware(
        "l4", "NVIDIA L4 (GDDR6)", 23034 * MiB, 300e9, 25e9, 7e9, 200e9, 121e12,
        "GDDR6 300 GB/s, 121 TFLOPS bf16 (datasheet); 23034 MiB (nvidia-smi); PCIe Gen4 ~25 GB/s H2D measured",
    ),
}  # fmt: skip


def get_hardware(
    key: str,
    *,
    hbm_gbps: float | None = None,
    link_gbps: float | None = None,
    nvme_gbps: float | None = None,
    host_gbps: float | None = None,
    hbm_gib: float | None = None,
    tflops: float | None = None,
    host_tflops: float | None = None,
) -> Hardware:
    """The documented constants of `key` (h100, h200, a100, l4), each overridable.
    Rates are given in GB/s (10**9 bytes/s) and TFLOP/s, the capacity in GiB.
    `host_tflops` is the rate the host reaches scoring re-rank candidates, not its peak."""
    name = str(key).strip().lower()
    if name not in HARDWARE:
        raise ConfigError(f"--hardware: {key!r} is not known; allowed: {', '.join(HARDWARE)}")
    hw = HARDWARE[name]
    changes: dict[str, Any] = {}
    for flag, value, attr, unit in (
        ("--hbm-gbps", hbm_gbps, "hbm_bytes_per_s", 1e9),
        ("--link-gbps", link_gbps, "link_bytes_per_s", 1e9),
        ("--nvme-gbps", nvme_gbps, "nvme_bytes_per_s", 1e9),
        ("--host-gbps", host_gbps, "host_bytes_per_s", 1e9),
        ("--tflops", tflops, "peak_flops", 1e12),
        ("--host-tflops", host_tflops, "host_flops", 1e12),
        ("--hbm-gib", hbm_gib, "hbm_bytes", GiB),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{flag}: {value!r} is not allowed; allowed: a number > 0")
        changes[attr] = int(value * unit) if attr == "hbm_bytes" else float(value * unit)
    if changes:
        hw = replace(hw, source=hw.source + "; overridden: " + ", ".join(sorted(changes)), **changes)
    return hw


# ----------------------------------------------------------------------------- the model's cost
@dataclass(frozen=True)
class Arch:
    """The dimensions of a dense decoder that set its parameter count and FLOPs."""

    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    tied: bool = False
    qkv_bias: bool = False
    extra_norms: int = 0  # hidden-sized norms per layer beyond the two (Gemma3: 2)
    qk_norm: bool = False  # a head_dim-sized norm on q and on k per layer (Gemma3)

    @property
    def params(self) -> int:
        """Parameter count: embeddings (and an untied head), per layer q/k/v/o, a gated
        MLP (3 matrices), the norms and biases; the final norm."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + (2 + self.extra_norms) * h
        if self.qkv_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab * h * (1 if self.tied else 2)
        return emb + self.layers * per_layer + h


# Published configs (config.json on the Hub); `Arch.params` gives 8,030,261,248 for
# Llama-3.1-8B, 70,553,706,496 for 70B, 7,615,616,512 for Qwen2.5-7B, 134,515,008 for
# SmolLM2-135M and 268,098,176 for Gemma-3-270m, their published counts.
ARCHS: dict[str, Arch] = {
    "llama-3.1-8b": Arch(4096, 14336, 128256, 32, 8, 128, 32),
    "llama-3.1-70b": Arch(8192, 28672, 128256, 64, 8, 128, 80),
    "qwen2.5-7b": Arch(3584, 18944, 152064, 28, 4, 128, 28, qkv_bias=True),
    "smollm2": Arch(576, 1536, 49152, 9, 3, 64, 30, tied=True),
    "gemma3-270m": Arch(640, 2048, 262144, 4, 1, 256, 18, tied=True, extra_norms=2, qk_norm=True),
}


def arch_from_config(cfg: dict[str, Any]) -> Arch | None:
    """An `Arch` from a transformers config dict of a dense decoder (Llama, Qwen2,
    Mistral, Gemma3 text), or None when it lacks a field or is a mixture of experts."""
    sub = cfg.get("text_config")
    text: dict[str, Any] = sub if isinstance(sub, dict) else cfg
    try:
        h, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        if any(k in text for k in ("num_experts", "n_routed_experts", "num_local_experts")):
            return None
        model_type = str(text.get("model_type", ""))
        return Arch(
            hidden=h,
            intermediate=int(text["intermediate_size"]),
            vocab=int(text["vocab_size"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or h // heads),
            layers=int(text["num_hidden_layers"]),
            tied=bool(text.get("tie_word_embeddings", False)),
            qkv_bias=bool(text.get("attention_bias", model_type.startswith("qwen2"))),
            extra_norms=2 if model_type.startswith("gemma3") else 0,
            qk_norm=model_type.startswith("gemma3"),
        )
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class ModelCost:
    """What one sequence of a model costs on a device (bytes and FLOPs)."""

    name: str
    params: int
    weight_bytes: int  # params x bytes per weight
    layers: int
    q_width: int  # attention heads x head_dim: sets attention FLOPs
    kv_bytes_per_token: float  # the full cache, every layer, K and V, one sequence (mean at this length)
    params_source: str = ""

    def attention_flops(self, query_tokens: int, context: int) -> float:
        """FLOPs of QK^T and PV for `query_tokens` queries each over `context` keys: 4 x q_width
        per query and key, per layer."""
        return 4.0 * self.layers * self.q_width * query_tokens * context

    def prefill_flops(self, tokens: int) -> float:
        """2 x params x tokens + causal attention: query i attends i keys (1..tokens), so
        sum 4 q_width i = 2 q_width tokens (tokens + 1) per layer."""
        return 2.0 * self.params * tokens + 2.0 * self.layers * self.q_width * tokens * (tokens + 1)


def model_cost(
    name: str,
    *,
    layers: int,
    kv_bytes_per_token: float,
    dtype_bytes: int,
    q_width: int,
    params: int | None = None,
    arch: Arch | None = None,
) -> ModelCost:
    """A `ModelCost` from the calculator's per-token bytes and the parameter count: `params`
    if given, else `arch` (or the built-in `ARCHS[name]`)."""
    arch = arch if arch is not None else ARCHS.get(name)
    if params is not None:
        if isinstance(params, bool) or not isinstance(params, int) or params < 1:
            raise ConfigError(f"--params: {params!r} is not allowed; allowed: a parameter count >= 1")
        src = "given (--params)"
    elif arch is not None:
        params, src = arch.params, "computed from the model's dimensions"
        q_width = arch.heads * arch.head_dim
    else:
        raise ConfigError(
            f"--params: the parameter count of {name!r} is not known; allowed: give --params N "
            f"(for a mixture of experts, the parameters read per token), or a built-in of {', '.join(ARCHS)}"
        )
    return ModelCost(name, params, params * dtype_bytes, layers, q_width, kv_bytes_per_token, src)


# ----------------------------------------------------------------------------- assumptions
@dataclass(frozen=True)
class Assumptions:
    """The model's stated assumptions (docs/accelerator.md gives the reasons)."""

    # HBM set aside beyond weights and KV: CUDA context, cuBLAS workspace, the allocator's
    # slack, one prefill chunk's activations and a step's logits
    activation_bytes: int = 2 * GiB
    # fraction of peak FLOP/s a prefill (and a decode step's matrix products) reaches
    flops_fraction: float = 0.5
    # prefetch on a copy stream: a step takes its slowest resource, else their sum
    overlap: bool = True
    # of the pages a flashmem step selects, the share not already on the device (ShadowKV's
    # cache of recently fetched chunks cut its fetches by about 60%, so 0.4)
    new_page_fraction: float = 0.4
    # where a re-ranking config reads its candidates' exact keys: "host" (scored by host compute
    # next to the cold tier, only page ids cross: the code on CUDA, `BlockReader.host_ranking`),
    # "link" (copied from the cold tier to the device: the code before 2026-12-02) or "device"
    # (a free ranker on device-resident data: no bytes and no FLOPs counted for it, a bound).
    # A config with `lsa_rerank_on_device` (built: codes held on the device) is modelled as
    # such whatever this says, unless it is "device"
    rerank_keys: str = "host"
    # with `lsa_rerank_on_device`: of a step's re-rank candidates, the share whose codes the
    # device did not hold the step before and which therefore cross the link. None: the same as
    # new_page_fraction (the candidates are the index's top pages, which move as the selected
    # pages do; cache.traffic_report()["candidate_cache"] measures it)
    new_candidate_fraction: float | None = None
    # the host's time to dispatch one operator that launches a kernel (eager PyTorch on CUDA:
    # PyTorch's operator micro-benchmarks give about 3.3 us for a small op, before the caller's
    # own Python) and one that only makes a view; `LayerOps` counts them per layer and step
    op_launch_s: float = 5e-6
    view_op_s: float = 1e-6
    # how that host time meets the device's: "overlap" (the host queues work ahead, so a step
    # takes the longer of the two: a lower bound), "serial" (flashmem's step waits on the device
    # several times a layer, `LayerOps.waits`, so its dispatch adds to the device's time: an
    # upper bound) or "off" (not counted, as the model was before 2026-12-03; what CUDA graphs or
    # a compiled step would approach)
    dispatch: str = "overlap"
    # with `exact_on_doubt` (cache/doubt.py): the share of decode steps redone exactly. None:
    # DOUBT_REDO_FRACTION, at most the config's cap (`exact_on_doubt_share`)
    doubt_redo_fraction: float | None = None

    @property
    def candidate_fraction(self) -> float:
        """The new-candidate fraction in force: `new_candidate_fraction`, else `new_page_fraction`."""
        return self.new_page_fraction if self.new_candidate_fraction is None else self.new_candidate_fraction

    def check(self) -> None:
        if not 0 <= self.new_page_fraction <= 1:
            raise ConfigError(f"--new-page-fraction: {self.new_page_fraction!r} is not allowed; allowed: 0 to 1")
        f = self.new_candidate_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1):
            raise ConfigError(f"--new-candidate-fraction: {f!r} is not allowed; allowed: 0 to 1")
        if not 0 < self.flops_fraction <= 1:
            raise ConfigError(f"--flops-fraction: {self.flops_fraction!r} is not allowed; allowed: above 0, up to 1")
        if self.activation_bytes < 0:
            raise ConfigError(f"--activation-gib: {self.activation_bytes / GiB!r} is not allowed; allowed: >= 0")
        if self.rerank_keys not in ("host", "link", "device"):
            raise ConfigError(f"--rerank-keys: {self.rerank_keys!r} is not allowed; allowed: host, link, device")
        if self.dispatch not in ("overlap", "serial", "off"):
            raise ConfigError(f"--dispatch: {self.dispatch!r} is not allowed; allowed: overlap, serial, off")
        f = self.doubt_redo_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1):
            raise ConfigError(f"--doubt-redo-fraction: {f!r} is not allowed; allowed: 0 to 1")
        if not (0 <= self.op_launch_s < 1e-3 and 0 <= self.view_op_s < 1e-3):
            raise ConfigError(f"--op-us: {self.op_launch_s * 1e6!r} is not allowed; allowed: 0 to 1000")


@dataclass(frozen=True)
class LayerOps:
    """What one layer's decode step dispatches from the host: operators that launch a kernel,
    operators that only make views, and points where the host may wait for the device (a
    tensor's value read, a boolean-mask index; counted on a CPU, where some of them read host
    tensors that on a GPU would not wait)."""

    kernels: float
    views: float
    waits: float = 0.0

    def seconds(self, a: Assumptions, layers: int) -> float:
        """Host dispatch time of a step over `layers` layers (0 with `dispatch: off`)."""
        if a.dispatch == "off":
            return 0.0
        return layers * (self.kernels * a.op_launch_s + self.views * a.view_op_s)

    def amortized(self, reuse: LayerOps, every: int) -> LayerOps:
        """A step's mean over `every` steps of which this one selects and the others reuse its
        selection (`lsa_select_every`). Its waits stay the selecting step's: a step with any
        wait is modelled serial, an upper bound where the reusing steps wait on nothing."""
        if every <= 1:
            return self
        w = (every - 1) / every
        return LayerOps(
            kernels=self.kernels / every + reuse.kernels * w,
            views=self.views / every + reuse.views * w,
            waits=self.waits,
        )


# Counted with `python benchmarks/diagnostics/ops_per_step.py --tokens 8192 --layers 2|4` (ATen
# operators of one decode step, this CPU, 2026-12-05; per layer: the 4-layer count less the
# 2-layer one, halved; results/ops_per_step.json): a transformers Llama layer over DynamicCache,
# and flashmem with the config an accelerator gets on its path (ranked on the host): at 1/16
# (exact re-rank), and with the candidates' int4 codes held on the device (at 1/4). The rest
# entry (the recipe's from 1/16 up since 2026-12-05) added 33 kernels a layer (214 and 282 before)
# and 39 to a step that reuses its selection (67 before), no wait; taking its value from the
# assembled values (stop 45) took 2 of them off again (247, 315 and 106 before).
FULL_LAYER_OPS = LayerOps(kernels=40, views=36, waits=0)
FLASH_LAYER_OPS = LayerOps(kernels=245, views=199, waits=13)
FLASH_DEVICE_CODES_OPS = LayerOps(kernels=313, views=233, waits=18)
# a step that reuses the last selection (`lsa_select_every`; `--select-every 64`)
FLASH_REUSE_LAYER_OPS = LayerOps(kernels=104, views=141, waits=0)
# `decode_step: static` (cache/static_step.py, lsa_rerank 1; `--static`, remeasured 2026-12-04,
# stop 43, results/ops_per_step_static.json and _2layers.json: the eager step with lsa_rerank 1
# counted 186 kernels and 12 waits a layer in the same runs; 101 kernels before the slots were
# found by sorts instead of a [k, k] match)
FLASH_STATIC_LAYER_OPS = LayerOps(kernels=108, views=99, waits=0)
# ... re-ranked by int4 codes held on the device (`--static --device-codes`, 2026-12-04, stop 43,
# results/ops_per_step_static_rerank.json and _2layers.json: the eager step with the same config
# counted 261 kernels and 18 waits a layer in the same runs)
FLASH_STATIC_RERANK_LAYER_OPS = LayerOps(kernels=176, views=125, waits=0)


def flash_layer_ops(traffic: FlashTraffic) -> LayerOps:
    """flashmem's operators a layer for its config: the static step's (re-ranked by held codes
    or not); the eager step's with the candidates' codes on the device or not, and with
    `lsa_select_every` N the mean of one selecting step and N - 1 reusing ones."""
    if traffic.static:
        return FLASH_STATIC_RERANK_LAYER_OPS if traffic.held_code_bytes else FLASH_STATIC_LAYER_OPS
    select = FLASH_DEVICE_CODES_OPS if traffic.held_code_bytes else FLASH_LAYER_OPS
    return select.amortized(FLASH_REUSE_LAYER_OPS, traffic.select_every)


# ----------------------------------------------------------------------------- flashmem's traffic
@dataclass(frozen=True)
class MeasuredFraction:
    """A new-page fraction measured by a run on this project's CPU: 1 - the working set's page hit
    rate (and, where the run counted it, the new-candidate fraction: 1 - the candidate hit rate)."""

    label: str
    new_page_fraction: float
    source: str
    new_candidate_fraction: float | None = None


# The working set's page hit rate per decode step (benchmarks/budget_peak.py, the field
# page_hit_rate), as new-page fractions: 1 - the lower hit rate of each file's rows. Beside the
# default 0.4 (ShadowKV's, an assumption), `flashmem estimate --hardware` shows the ratios at these.
# The Gemma3 16K rows are the config an accelerator gets at 1/8 (`--as-device`: 256 pages, capped)
# with a page cache of none, 43 pages (0.17 x the selection, the share the recipe has room for at
# 128K and 1/16 on Llama-3.1-8B) and 128 (the recipe's at 16K), on a KJV prompt and question.
# tests/test_hardware_model.py reads the files and checks these figures.
MEASURED_NEW_PAGE_FRACTIONS = (
    MeasuredFraction(
        "SmolLM2 measured", 0.067, "results/budget_peak_smollm2_peak.jsonl: hit rates 0.933 (4K), 0.940 (8K)"
    ),
    MeasuredFraction(
        "Gemma3 measured",
        0.361,
        "results/budget_peak_gemma3.jsonl: hit rates 0.639 (4K), 0.655 (16K), an older recipe",
    ),
    MeasuredFraction(
        "Gemma3 16K 1/8, no page cache",
        0.233,
        "results/budget_peak_gemma3_16k_cache0.jsonl: page hit rate 0.767, candidate hit rate 0.967",
        0.033,
    ),
    MeasuredFraction(
        "Gemma3 16K 1/8, page cache 0.17x",
        0.196,
        "results/budget_peak_gemma3_16k_cache43.jsonl: page hit rate 0.804, candidate hit rate 0.965",
        0.035,
    ),
    MeasuredFraction(
        "Gemma3 16K 1/8, page cache 0.5x",
        0.127,
        "results/budget_peak_gemma3_16k_cache128.jsonl: page hit rate 0.873, candidate hit rate 0.967",
        0.033,
    ),
)


# The re-rank scores its candidates in place, over every sealed block of a memory cold tier,
# when they are at least 1/IN_PLACE_CANDIDATES of the sealed pages (cache/ranking.py's constant
# of the same name; tests/test_hardware_model.py checks that they agree)
IN_PLACE_CANDIDATES = 3
# exact_on_doubt's redone share of decode steps, measured: SmolLM2 at 4K and 1/16 on the task
# families' answers, 153 of 1,374 steps (11%), then 30 of 273 and 38 of 315 on held-out seeds
# (12%; docs/results.md, "Near ties decided exactly" and "A cap on the redone steps"); on every
# answered prompt at 4K and 1/16, 367 of 3,153 (11.6%; "The README's tables rebuilt")
DOUBT_REDO_FRACTION = 0.12
# FLOPs per score beyond its dot product (2 x head_dim): the scaling, the softmax's max-subtract,
# exp and sum. An exp takes more than one instruction; at head_dim 128 this is still ~2-4%.
SOFTMAX_FLOPS_PER_SCORE = 4


@dataclass(frozen=True)
class FlashTraffic:
    """flashmem's bytes per sequence: what it holds on the device and what a step moves."""

    resident_bytes: int  # device-resident tiers in steady decode
    prompt_bytes: int  # extra device bytes while one sequence's prompt runs (its exact prompt)
    device_read_bytes: float  # read from HBM per decode step (the KV part; weights added later)
    link_bytes: float  # host to device per decode step
    disk_bytes: float  # read from disk per decode step
    host_read_bytes: float  # read by compute on the host per decode step
    prefill_link_bytes: float  # host to device over a whole prompt
    attended_tokens: int  # keys a decode step attends per layer (for its FLOPs)
    source: str
    parts: dict[str, float] = field(default_factory=dict)  # where link_bytes come from
    host_flops: float = 0.0  # computed on the host per decode step (the re-rank's scores)
    rerank_device_flops: float = 0.0  # the re-rank's scores when the device computes them
    # the candidates' codes held on the device (`lsa_rerank_on_device`), already inside
    # resident_bytes (the index's tier): read once a step with the rest of it
    held_code_bytes: float = 0.0
    # pages held past the selection (lsa_cache_pages), inside resident_bytes but not read per step
    page_cache_bytes: float = 0.0
    # HBM bytes of updating the working set per step (new pages into their slots; a rebuild where
    # the page count changes), beside device_read
    working_set_merge_bytes: float = 0.0
    # HBM bytes a step writes and reads back besides what it holds (`assembly_bytes`), inside
    # device_read_bytes: attention's K/V buffer, an int8 working set decoded, the index converted
    assembly_bytes: float = 0.0
    # decode steps one selection serves (`lsa_select_every`): the ranking's and the gather's
    # bytes, FLOPs and operators above are already the mean over them
    select_every: int = 1
    # `decode_step: static`: fixed-size page reads, no host waits (`FLASH_STATIC_LAYER_OPS`)
    static: bool = False
    # exact_on_doubt: the share of steps redone and the tokens a redo feeds again. A redo's read
    # of the whole cold tier is in link_bytes (and disk_bytes) already, as the mean a step; its
    # second forward (the weights read again, the FLOPs of `redo_tokens` tokens attending every
    # earlier one) is added by `flashmem_row`
    redo_fraction: float = 0.0
    redo_tokens: int = 0


def rebuild_fraction(cfg: Any, head_dim: int | None, dtype_bytes: float | None) -> float:
    """The share of decode steps whose working set changes its page count, so is rebuilt rather
    than written in place (cache/working_set.py): the count changes when a block seals (k grows
    with the pages) and, with `lsa_open_room`, each time the open block's filling takes back one
    page's bytes of room: (B - 1) tokens of K/V in the model's dtype over a page as the working
    set holds it (int8: d codes and an fp32 scale an element row). 1 (every step) where the
    geometry is unknown or the pages sit in order (`position_mode: window`)."""
    B = int(cfg.hca_chunk_size)
    if not head_dim or not dtype_bytes or cfg.position_mode == "window" or B < 2:
        return 1.0
    changes = 1.0
    if cfg.lsa_open_room:
        token = 2 * head_dim * float(dtype_bytes)
        per_elem = head_dim + 4 if cfg.working_set_codec == "int8" else head_dim * float(dtype_bytes)
        page = 2 * int(cfg.page_tokens) * per_elem
        changes += min(B - 1, (B - 1) * token / page)
    return min(1.0, changes / B)


def predicted_traffic(
    flash: Any,
    cfg: Any,
    tokens: int,
    a: Assumptions,
    head_dim: int | None = None,
    dtype_bytes: float | None = None,
    group: int = 1,
) -> FlashTraffic:
    """flashmem's traffic predicted from a config: `flash` is the calculator's
    `FlashEstimate` for ONE sequence (`estimate(..., batch=1, config=cfg).flashmem`).
    head_dim, dtype_bytes (the model's): with them, ranked on the host, an int8 working set's
    new pages are counted as they cross the link, as codes (1 + 4/head_dim bytes an element).
    A config that re-ranks needs them (and `group`, query heads per KV head) for its key bytes
    under `lsa_rerank_codec` and its score FLOPs. With `lsa_rerank_on_device` (and a code) the
    candidates' codes are held on the device and scored there: `new_candidate_fraction` of
    them cross the link per step, nothing is read or computed on the host."""
    from flashmem.config import rerank_key_bytes
    from flashmem.sizing.tiers import candidate_code_bytes, codec_bytes_per_element

    counts = flash.tier_counts  # per managed layer, per sequence, token-equivalents
    cold_tok = float(flash.cold_bytes_per_token)  # K+V of one sealed token, every managed layer
    page = int(cfg.page_tokens)
    sealed_pages = int(counts["sealed_blocks"]) * int(cfg.pages_per_block)
    selected_tokens = int(counts["working_set"])
    new_exact = a.new_page_fraction * selected_tokens * cold_tok
    new_pages = new_exact
    static = getattr(cfg, "decode_step", "eager") in ("static", "graph")
    fetch_share = 1.0
    capped: int | None = None  # pages a static step reads with lsa_fetch_share (None: every one)
    if static:
        # cache/static_step.py: the device reads a fixed number of pages a step, new or not:
        # `lsa_fetch_share` of the selected pages, else every one; an int8 working set's as the
        # host coded them (cache/page_codes.py: d codes and an fp32 scale a token and head)
        share = getattr(cfg, "lsa_fetch_share", None)
        k = max(1, selected_tokens // page)
        capped = None if share is None else math.ceil(float(share) * k)
        fetch_share = 1.0 if capped is None else min(1.0, capped / k)
        new_exact = new_pages = fetch_share * selected_tokens * cold_tok
        if cfg.working_set_codec == "int8" and head_dim and dtype_bytes:
            new_pages = new_exact * (1 + 4 / head_dim) / dtype_bytes
    if not static and a.rerank_keys == "host" and cfg.working_set_codec == "int8" and head_dim and dtype_bytes:
        # cut on the host, an int8 working set's new pages cross as their codes (cache/working_set.py)
        new_pages = new_exact * (1 + 4 / head_dim) / dtype_bytes
    rerank = host = disk_keys = flops = held = decoded = 0.0
    cand_share = a.candidate_fraction  # of the held candidates' codes, read a step
    codec = str(cfg.lsa_rerank_codec)
    # codes held on the device (cache/rerank_codes.py DeviceCandidates): the config decides,
    # not `rerank_keys`, except its free "device" ranker
    on_device = bool(getattr(cfg, "lsa_rerank_on_device", False)) and codec != "exact"
    in_place = False
    cap = cfg.lsa_rerank_max_tokens
    reranks = cap is None or int(counts["cold_tokens"]) <= cap  # past the cap the index's choice stands
    if int(cfg.lsa_rerank) > 1 and a.rerank_keys != "device" and selected_tokens and reranks:
        if not head_dim or not dtype_bytes or group < 1:
            raise ConfigError(
                "predicted_traffic: a re-ranking config needs head_dim, dtype_bytes and group >= 1; "
                "allowed: the model's head size, element bytes and query heads per KV head"
            )
        # the index picks max(rerank x selected, floor) candidate pages per head and layer; their
        # keys are read from the cold tier (issue 27: 1 GiB/step at 128K, 1/16, exact): over the
        # link, or by host compute next to the cold tier (memory, or disk blocks read into host
        # memory). Ranked on the host with a memory cold tier, candidates that are a third of the
        # pages or more are scored in place over every sealed block (cache/ranking.py)
        cand = min(sealed_pages, max(int(cfg.lsa_rerank) * (selected_tokens // page), int(cfg.lsa_rerank_min_pages)))
        in_place = (
            not on_device
            and a.rerank_keys == "host"
            and cfg.cold_store == "memory"
            and IN_PLACE_CANDIDATES * cand >= sealed_pages
        )
        scored = (sealed_pages if in_place else cand) * page  # tokens scored per KV head and layer
        # K elements of one sealed token over every managed layer: half the cold tier's K+V
        key_elems = cold_tok / 2 / codec_bytes_per_element(str(cfg.cold_codec), int(dtype_bytes))
        if on_device:
            # held per KV head and layer as the calculator counts them in the index's bytes
            # (tiers.candidate_code_bytes: codes + an fp16 zero and scale per channel and page);
            # key_elems / head_dim is the managed layers x KV heads
            held = (
                key_elems
                / head_dim
                * candidate_code_bytes(cfg, sealed_pages, selected_tokens // page, head_dim, dtype_bytes)
            )
            # only the candidates the last step did not hold are gathered from the host's code
            # arena (filled at seal, so no disk read per step) and cross; that gather reads from
            # host DRAM the same bytes the link carries, which the slower link bounds: not counted.
            # The static step reads a fixed share of them instead, new or not (cache/static_step.py)
            keys = a.candidate_fraction * held
            if static:  # as many candidates' codes a step as pages
                cand_share = 1.0 if capped is None else min(1.0, capped / cand)
                keys = cand_share * held
        elif codec == "exact":  # as the cold tier holds them
            keys = scored * cold_tok / 2
            # a disk tier's blocks are read whole (K and V)
            disk_keys = 2 * keys
        else:  # the block codes kept beside the cold tier (compress/key_code.py)
            keys = scored * key_elems * rerank_key_bytes(codec, dtype_bytes, int(cfg.hca_chunk_size))
            # in host memory whatever the cold tier (coded at seal: cache/rerank_codes.py): no disk read
        # each of the group's queries scores every key: 2 FLOPs an element, plus the softmax per score
        flops = scored * group * (2 * key_elems + SOFTMAX_FLOPS_PER_SCORE * key_elems / head_dim)
        host, rerank = (keys, 0.0) if a.rerank_keys == "host" and not on_device else (0.0, keys)
        if codec != "exact" and not host:
            # scored on the device, the codes are decoded a chunk at a time into the model's dtype
            # (index/rerank.py coded_page_mass): those keys are written to HBM and read back
            decoded = 2 * scored * key_elems * dtype_bytes
    # lsa_select_every r: one step in r ranks and gathers; the others attend its pages as held.
    # The ranking's reads and FLOPs, the working set's writes and the index's read come once in
    # r steps. The new pages do not shrink: the pages that changed over r steps, gathered at
    # once, are at most r steps' worth (the per-step fraction stays an upper bound).
    every = max(1, int(getattr(cfg, "lsa_select_every", 1)))
    rerank, host, disk_keys, flops, decoded = (x / every for x in (rerank, host, disk_keys, flops, decoded))
    link = new_pages + rerank
    # pages kept past the selection (lsa_cache_pages) sit in the working set's tier but are not
    # attended: not read by a step, except where pages leave the selection into their slots (a
    # read and a write each; at most the selection's pages a step, or the cache's, if fewer)
    ws_tokens = selected_tokens + int(counts.get("page_cache", 0))
    cache_bytes = flash.tiers["working_set"] * int(counts.get("page_cache", 0)) / ws_tokens if ws_tokens else 0.0
    selection = flash.tiers["working_set"] - cache_bytes
    spill = 2 * min(cache_bytes, selection)
    # a step that keeps the page count writes the new pages into the slots of those that left (a
    # read and a write of them: cache/working_set.py _merge_in_place); one that changes it rebuilds
    # the working set (a cat of held and new rows, then an index_select: two reads and two writes)
    rebuilds = rebuild_fraction(cfg, head_dim, dtype_bytes)
    merge = rebuilds * 4 * selection + (1 - rebuilds) * 2 * a.new_page_fraction * selection
    if static:  # the fetched pages written into their slots, never a rebuild
        merge = 2 * fetch_share * selection
    merge, spill = merge / every, spill / every
    # held codes are in the index's tier: neither is read by a step that reuses the selection
    index_skipped = (1 - 1 / every) * float(flash.tiers.get("index", 0.0))
    # worst case: no host RAM cache hits
    disk = new_exact + disk_keys if cfg.cold_store in ("disk", "lmdb") else 0.0
    # exact_on_doubt: a redone step attends every sealed token exactly, read from the cold tier
    # as the streamed exact prompt reads it: the whole cold tier over the link (and off the disk)
    redo, redo_tokens = doubt_redo(cfg, a)
    redo_bytes = redo * float(counts["cold_tokens"]) * cold_tok
    link += redo_bytes
    disk += redo_bytes if cfg.cold_store in ("disk", "lmdb") else 0.0
    # the streamed exact prompt (issue 27 item 3): chunk j of C tokens reads every earlier token
    # that is not resident (sinks + window) from the cold tier
    chunk = max(1, int(cfg.prefill_chunk))
    resident_tok = int(counts["sinks"]) + int(counts["window"])
    n_chunks = -(-tokens // chunk)
    behind = _tokens_behind(n_chunks, chunk, resident_tok)
    attended = int(counts["sinks"]) + int(counts["window"]) + int(counts["open_block"]) + selected_tokens
    assembly = assembly_bytes(cfg, counts, cold_tok, head_dim, dtype_bytes)
    what = f"{codec} keys" if codec == "exact" else f"{codec} codes"
    where = ", in place over every sealed page" if in_place else ""
    over = f", re-rank {what} over the link"
    if held:
        over = f", re-rank {what} held on the device and scored there, " + (
            f"{cand_share:g} of the candidates' codes read per step"
            if static
            else f"{cand_share:g} of the candidates new per step (their codes over the link)"
        )
    return FlashTraffic(
        resident_bytes=int(flash.device_resident_bytes),
        prompt_bytes=int(flash.prompt_kv_bytes),
        device_read_bytes=(
            float(flash.device_resident_bytes) - cache_bytes - index_skipped + spill + merge + link + decoded + assembly
        ),
        link_bytes=link,
        disk_bytes=disk,
        host_read_bytes=host,
        prefill_link_bytes=behind * cold_tok,
        attended_tokens=attended,
        source=(
            "predicted from the config: "
            + (
                f"static step, {fetch_share:g} of the selected pages read per step"
                if static
                else f"{a.new_page_fraction:g} of the selected pages new per step"
            )
            + (over if rerank or held else "")
            + (f", re-rank {what} read and scored on the host{where}" if host else "")
            + (
                f", exact_on_doubt: {redo:g} of the steps redone, each reading the whole cold tier and "
                f"running {redo_tokens} tokens again"
                if redo
                else ""
            )
        ),
        parts={
            "new_pages": new_pages,
            "rerank_keys": rerank,
            "rerank_keys_on_host": host,
            "rerank_decoded_keys": decoded,
            "doubt_redo": redo_bytes,
        },
        working_set_merge_bytes=merge,
        assembly_bytes=assembly,
        page_cache_bytes=cache_bytes,
        host_flops=flops if host else 0.0,
        rerank_device_flops=flops if rerank or held else 0.0,
        held_code_bytes=held,
        select_every=every,
        static=static,
        redo_fraction=redo,
        redo_tokens=redo_tokens,
    )


# cache/doubt.py's REDO_MAX_TOKENS (tests/test_hardware_model.py checks that they agree)
REDO_MAX_TOKENS = 64


def doubt_redo(cfg: Any, a: Assumptions) -> tuple[float, int]:
    """(share of decode steps redone, tokens a redo feeds again) for a config with
    `exact_on_doubt` (0, 0 without): `a.doubt_redo_fraction`, else DOUBT_REDO_FRACTION, never
    more than the cap lets through over a long answer (`exact_on_doubt_share`). A redo feeds
    again every token since the last one: 1 / share of them on average, at most REDO_MAX_TOKENS."""
    if not float(getattr(cfg, "exact_on_doubt", 0.0) or 0.0) > 0:
        return 0.0, 0
    share = DOUBT_REDO_FRACTION if a.doubt_redo_fraction is None else float(a.doubt_redo_fraction)
    share = min(share, float(cfg.exact_on_doubt_share))
    if share <= 0:
        return 0.0, 0
    return share, min(REDO_MAX_TOKENS, max(1, round(1 / share)))


def assembly_bytes(
    cfg: Any, counts: dict[str, Any], cold_tok: float, head_dim: int | None, dtype_bytes: float | None
) -> float:
    """HBM bytes a decode step writes and reads back besides the tiers it holds, per sequence,
    every managed layer (0 where the geometry is unknown):

    - attention's K/V buffer (cache/assembly.py `concat`): every attended part (sinks, HCA and
      CSA entries, the working set, the open block, the window) is copied into one buffer in
      the model's dtype, written, then read by SDPA;
    - an int8 working set is decoded into that buffer in one pass on an accelerator (a mixed-dtype
      multiply, `torch.mul(codes, scale, out=)`): its codes are read as held, nothing more (on a
      CPU a copy then a scale pass, which vectorises there: not modelled);
    - int8 or float16 index vectors are converted to the model's dtype for the scores
      (index/mean_key.py `score_coded`, index/vectors.py `read`), written and read back.

    A fused kernel that attends int8 pages where they lie, and scores the index from its codes,
    would not pay these; SDPA over one buffer does."""
    from flashmem.sizing.tiers import codec_bytes_per_element

    if not head_dim or not dtype_bytes:
        return 0.0
    # layers x KV heads: one sealed token's K elements over every managed layer, per head_dim
    heads = cold_tok / 2 / codec_bytes_per_element(str(cfg.cold_codec), int(dtype_bytes)) / head_dim
    token = 2 * head_dim * float(dtype_bytes)  # K and V of one token, in the model's dtype
    parts = ("sinks", "window", "open_block", "working_set", "csa_entries", "hca_entries")
    attended = sum(int(counts.get(p, 0)) for p in parts)
    if not cfg.use_summaries:  # HCA entries read by a scorer are not attended
        attended -= int(counts.get("hca_entries", 0)) + int(counts.get("csa_entries", 0))
    per_head = 2 * attended * token  # the buffer written, then read
    index_dtype = str(cfg.lsa_index_dtype)
    if index_dtype in ("int8", "float16"):  # (a float16 model's float16 index is not copied: bf16 assumed)
        per_head += 2 * int(counts["index_key_vectors"]) * head_dim * float(dtype_bytes)
    return heads * per_head


def _tokens_behind(n_chunks: int, chunk: int, resident: int) -> int:
    """sum over j < n_chunks of max(0, j * chunk - resident), in closed form (any length)."""
    first = resident // chunk + 1  # the first chunk with cold tokens behind it
    if first >= n_chunks:
        return 0
    count = n_chunks - first
    return chunk * (first + n_chunks - 1) * count // 2 - resident * count


TRAFFIC_KEYS = ("device_read_bytes", "h2d_bytes", "disk_read_bytes", "host_read_bytes")


def load_traffic(path: str | Path) -> dict[str, Any]:
    """Read and check a `cache.traffic_report()` JSON file (schema in docs/accelerator.md)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--traffic: {p}: no such file; allowed: a JSON file from cache.traffic_report()") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--traffic: {p}: cannot be read as JSON ({type(exc).__name__})") from None
    check_traffic(data, str(p))
    return data


def check_traffic(data: Any, where: str = "traffic") -> None:
    """Raise a one-line ConfigError unless `data` has traffic_report()'s schema."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"--traffic: {where}: {what}; allowed: the JSON of cache.traffic_report()")

    def count(v: Any, name: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise bad(f"{name} is {v!r}, not a count >= 0")

    if not isinstance(data, dict):
        raise bad("not a JSON object")
    for section in ("steps", "totals", "per_decode_step_median"):
        if not isinstance(data.get(section), dict):
            raise bad(f"missing the object {section!r}")
    prefill = _prefill_median(data)
    if not isinstance(prefill, dict):
        raise bad("missing the object 'per_prefill_chunk_median' (or 'per_prefill_forward_median')")
    count(_prefill_count(data), "steps.prefill_chunks")
    count(data["steps"].get("decode_steps"), "steps.decode_steps")
    for section, values in (
        ("totals", data["totals"]),
        ("per_decode_step_median", data["per_decode_step_median"]),
        ("per_prefill_chunk_median", prefill),
    ):
        for k in TRAFFIC_KEYS:
            count(values.get(k), f"{section}.{k}")
        if "device_copy_bytes" in values:  # (files from before it was counted have none)
            count(values["device_copy_bytes"], f"{section}.device_copy_bytes")
    count(data.get("full_cache_bytes"), "full_cache_bytes")
    count(data.get("layers"), "layers")
    # exact_on_doubt's redo forwards (optional: files from before they were counted apart have none)
    for k in ("redo_forwards", "redo_tokens"):
        if k in data["steps"]:
            count(data["steps"][k], f"steps.{k}")
    if data["steps"].get("redo_forwards"):
        redo = data.get("per_redo_forward_median")
        if not isinstance(redo, dict):
            raise bad("steps.redo_forwards is counted, but the object 'per_redo_forward_median' is missing")
        for k in TRAFFIC_KEYS:
            count(redo.get(k), f"per_redo_forward_median.{k}")


def _prefill_median(data: dict[str, Any]) -> Any:
    """The per-prompt-forward medians: `per_prefill_chunk_median`, or the cache's own name for
    them, `per_prefill_forward_median`."""
    return data.get("per_prefill_chunk_median", data.get("per_prefill_forward_median"))


def _prefill_count(data: dict[str, Any]) -> Any:
    steps = data.get("steps", {})
    return steps.get("prefill_chunks", steps.get("prefill_forwards"))


def counted_traffic(report: dict[str, Any], resident_bytes: int, prompt_bytes: int, source: str) -> FlashTraffic:
    """flashmem's traffic as a run counted it (`cache.traffic_report()`, one sequence): the
    per-decode-step medians drive a step; a prompt is the per-forward median x its forwards
    (`prefill_chunks` / `per_prefill_chunk_median`, or `prefill_forwards` /
    `per_prefill_forward_median`; other keys are ignored). The
    figures are for the run's own model, length and config."""
    step = report["per_decode_step_median"]
    chunk = _prefill_median(report)
    # exact_on_doubt: a redone step's second forward, counted apart (`steps.redo_forwards`); its
    # median reads join a step's as the mean over steps, as `predicted_traffic` adds them
    steps = report["steps"]
    redos, decodes = int(steps.get("redo_forwards", 0) or 0), int(steps.get("decode_steps", 0) or 0)
    redo = redos / decodes if redos and decodes else 0.0
    per_redo = report.get("per_redo_forward_median") or {}

    def mean(path: str) -> float:
        return float(step.get(path, 0)) + redo * float(per_redo.get(path, 0))

    return FlashTraffic(
        resident_bytes=resident_bytes,
        prompt_bytes=prompt_bytes,
        # the copies attention and the index make count as HBM traffic too (older files: none)
        device_read_bytes=mean("device_read_bytes") + mean("device_copy_bytes"),
        link_bytes=mean("h2d_bytes"),
        disk_bytes=mean("disk_read_bytes"),
        host_read_bytes=mean("host_read_bytes"),
        prefill_link_bytes=float(chunk["h2d_bytes"]) * int(_prefill_count(report)),
        attended_tokens=0,
        assembly_bytes=mean("device_copy_bytes"),
        # a run counts bytes, not FLOPs: its host reads bound the host's DRAM time only
        source=f"counted: {source} (per-decode-step medians of that run; host FLOPs not counted"
        + (
            f"; {redos} of its {decodes} decode steps redone on doubt, their median redo's reads added "
            f"as the mean a step)"
            if redo
            else ")"
        ),
        redo_fraction=redo,
        redo_tokens=round(int(steps.get("redo_tokens", 0) or 0) / redos) if redos else 0,
    )


# ----------------------------------------------------------------------------- rows
@dataclass
class Row:
    """One way of holding the cache on one device: its fit, a step at `batch` and at the
    largest batch that fits, and one prompt's prefill. Times in seconds, bytes per step."""

    method: str
    device_bytes_per_seq: float  # HBM a sequence adds
    fixed_device_bytes: float  # weights + allowance (+ one prompt's transient)
    largest_batch: int
    batch: int
    step_s: float
    bound: str
    hbm_bytes_per_step: float
    link_bytes_per_step: float
    step_s_at_largest: float
    bound_at_largest: str
    prefill_s: float
    prefill_bound: str
    prefill_link_bytes: float
    host_bytes_per_seq: float  # host memory a sequence needs (cold tier / offloaded cache)
    note: str = ""

    @property
    def fits(self) -> bool:
        """Whether `batch` sequences fit in HBM."""
        return self.batch <= self.largest_batch

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s if self.step_s > 0 else 0.0

    @property
    def tokens_per_s_at_largest(self) -> float:
        return self.largest_batch / self.step_s_at_largest if self.largest_batch and self.step_s_at_largest else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fits"] = self.fits
        d["tokens_per_s"] = self.tokens_per_s
        d["tokens_per_s_at_largest"] = self.tokens_per_s_at_largest
        return d


def step_time(
    hw: Hardware,
    a: Assumptions,
    *,
    hbm: float,
    link: float = 0.0,
    disk: float = 0.0,
    host: float = 0.0,
    flops: float = 0.0,
    host_flops: float = 0.0,
    dispatch: float = 0.0,
    waits: bool = False,
) -> tuple[float, str]:
    """Seconds for one step and the resource that sets it (roofline). `flops` run on the
    device at `flops_fraction` of its peak, `host_flops` on the host at `hw.host_flops`;
    `dispatch` seconds of the host launching the step's operators, which with `waits` (the step
    waits on the device within each layer) and `dispatch: serial` add to the rest."""
    if waits and a.dispatch == "serial" and a.overlap and dispatch > 0:
        t, bound = step_time(hw, a, hbm=hbm, link=link, disk=disk, host=host, flops=flops, host_flops=host_flops)
        return t + dispatch, bound + " + host dispatch (serial)"
    parts = {
        "HBM": hbm / hw.hbm_bytes_per_s,
        "link": link / hw.link_bytes_per_s,
        "NVMe": disk / hw.nvme_bytes_per_s,
        "host DRAM": host / hw.host_bytes_per_s,
        "host compute": host_flops / hw.host_flops,
        "compute": flops / (a.flops_fraction * hw.peak_flops),
        "host dispatch": dispatch,
    }
    bound = max(parts, key=lambda k: parts[k])
    if a.overlap:
        return parts[bound], bound
    return sum(parts.values()), bound + " (serial sum)"


def largest_batch(hw: Hardware, fixed: float, per_seq: float, host_bytes: int | None, host_per_seq: float) -> int:
    """floor((HBM - fixed) / per sequence), and no more than host memory holds if given."""
    if per_seq <= 0:
        return 0
    n = max(0, math.floor((hw.hbm_bytes - fixed) / per_seq))
    if host_bytes is not None and host_per_seq > 0:
        n = min(n, math.floor(host_bytes / host_per_seq))
    return n


def _prefill(hw: Hardware, a: Assumptions, m: ModelCost, tokens: int, link: float) -> tuple[float, str]:
    return step_time(
        hw, a, hbm=m.weight_bytes + tokens * m.kv_bytes_per_token, link=link, flops=m.prefill_flops(tokens)
    )


def full_row(
    hw: Hardware, m: ModelCost, tokens: int, batch: int, a: Assumptions, kv_passes: int = 1, method: str = "full"
) -> Row:
    """The whole cache in HBM. A step reads the weights once and each sequence's K/V
    `kv_passes` times (1: an ideal cache; DynamicCache's torch.cat reads and writes it once
    more: 3)."""
    kv = float(tokens * m.kv_bytes_per_token)
    fixed = m.weight_bytes + a.activation_bytes

    dispatch = FULL_LAYER_OPS.seconds(a, m.layers)  # the batch's rows share each operator

    def at(b: int) -> tuple[float, str, float]:
        hbm = m.weight_bytes + b * kv * kv_passes
        flops = b * (2.0 * m.params + m.attention_flops(1, tokens))
        t, bound = step_time(hw, a, hbm=hbm, flops=flops, dispatch=dispatch)
        return t, bound, hbm

    big = largest_batch(hw, fixed, kv, None, 0)
    t, bound, hbm = at(batch)
    tl, bl, _ = at(big) if big else (0.0, "does not fit", 0.0)
    pt, pb = _prefill(hw, a, m, tokens, 0.0)
    return Row(method, kv, fixed, big, batch, t, bound, hbm, 0.0, tl, bl, pt, pb, 0.0, 0.0)


def offloaded_row(hw: Hardware, m: ModelCost, tokens: int, batch: int, a: Assumptions, host_bytes: int | None) -> Row:
    """The whole cache in host memory, each layer's K/V copied to the device every step
    (two layers resident: the one computing and the one prefetched). Its copy back to the
    host (D2H, the other direction of the link) is not on the H2D path and is not counted."""
    kv = float(tokens * m.kv_bytes_per_token)
    per_seq = 2 * kv / m.layers
    fixed = m.weight_bytes + a.activation_bytes

    def at(b: int) -> tuple[float, str, float]:
        hbm = m.weight_bytes + b * kv  # what arrives is read once by attention
        flops = b * (2.0 * m.params + m.attention_flops(1, tokens))
        # the full cache's operators (its per-layer copies are a few more launches: not counted)
        t, bound = step_time(hw, a, hbm=hbm, link=b * kv, flops=flops, dispatch=FULL_LAYER_OPS.seconds(a, m.layers))
        return t, bound, hbm

    big = largest_batch(hw, fixed, per_seq, host_bytes, kv)
    t, bound, hbm = at(batch)
    tl, bl, _ = at(big) if big else (0.0, "does not fit", 0.0)
    pt, pb = _prefill(hw, a, m, tokens, 0.0)  # one forward: K/V leave per layer, D2H (not counted)
    return Row("offloaded", per_seq, fixed, big, batch, t, bound, hbm, batch * kv, tl, bl, pt, pb, 0.0, kv)


def flashmem_row(
    hw: Hardware,
    m: ModelCost,
    tokens: int,
    batch: int,
    a: Assumptions,
    traffic: FlashTraffic,
    cold_bytes_per_seq: float,
    host_bytes: int | None,
) -> Row:
    """flashmem: resident tiers per sequence in HBM, one sequence's prompt transient at a
    time (prompts are prefilled one by one), the cold tier on the host."""
    per_seq = float(traffic.resident_bytes)
    fixed = m.weight_bytes + a.activation_bytes + traffic.prompt_bytes
    attended = traffic.attended_tokens or tokens
    ops = flash_layer_ops(traffic)
    dispatch = ops.seconds(a, m.layers)  # rows of one cache share each operator

    # exact_on_doubt: each sequence's redone steps run a second forward of redo_tokens tokens
    # that attend every earlier token (its cold-tier read is in link_bytes already)
    redo, n = traffic.redo_fraction, traffic.redo_tokens
    redo_flops = redo * (2.0 * m.params * n + m.attention_flops(n, tokens)) if redo else 0.0

    def at(b: int) -> tuple[float, str, float, float]:
        hbm = m.weight_bytes * (1 + b * redo) + b * traffic.device_read_bytes
        link = b * traffic.link_bytes
        flops = b * (2.0 * m.params + m.attention_flops(1, attended) + traffic.rerank_device_flops + redo_flops)
        t, bound = step_time(
            hw, a, hbm=hbm, link=link, disk=b * traffic.disk_bytes, host=b * traffic.host_read_bytes, flops=flops,
            host_flops=b * traffic.host_flops, dispatch=dispatch, waits=ops.waits > 0,
        )  # fmt: skip
        return t, bound, hbm, link

    big = largest_batch(hw, fixed, per_seq, host_bytes, cold_bytes_per_seq)
    t, bound, hbm, link = at(batch)
    tl, bl, _, _ = at(big) if big else (0.0, "does not fit", 0.0, 0.0)
    pt, pb = _prefill(hw, a, m, tokens, traffic.prefill_link_bytes)
    return Row(
        "flashmem", per_seq, fixed, big, batch, t, bound, hbm, link, tl, bl, pt, pb,
        traffic.prefill_link_bytes, cold_bytes_per_seq, note=traffic.source,
    )  # fmt: skip


# ----------------------------------------------------------------------------- targets
TARGET_THROUGHPUT_RATIO = 3.0  # issue 27: flashmem at its largest batch vs the full cache at its own


def targets(
    hw: Hardware, m: ModelCost, a: Assumptions, full_b1: Row, flash_b1: Row, traffic: FlashTraffic
) -> dict[str, Any]:
    """Issue 27's two modelled targets, and the link bytes per sequence and step at which the
    first would hold. `*_b1` rows are computed at batch 1."""
    if full_b1.largest_batch == 0 or flash_b1.largest_batch == 0:
        # a cache that does not hold one sequence has no throughput to compare
        who = "the full cache" if full_b1.largest_batch == 0 else "flashmem"
        return {
            "throughput_ratio_at_largest_batch": None,
            "throughput_ratio_target": TARGET_THROUGHPUT_RATIO,
            "throughput_target_met": None,
            "batch1_speed_ratio": None,
            "batch1_target_met": None,
            "link_bytes_per_seq_step_for_target": None,
            "note": f"{who} does not fit one sequence at this length",
        }
    ratio_fill = flash_b1.tokens_per_s_at_largest / full_b1.tokens_per_s_at_largest
    ratio_b1 = full_b1.step_s / flash_b1.step_s
    need: float | None = None
    b = flash_b1.largest_batch
    if b and full_b1.tokens_per_s_at_largest:
        t_max = b / (TARGET_THROUGHPUT_RATIO * full_b1.tokens_per_s_at_largest)
        hbm = m.weight_bytes + b * (traffic.device_read_bytes - traffic.link_bytes)
        attended = traffic.attended_tokens or 1
        flops = b * (2.0 * m.params + m.attention_flops(1, attended) + traffic.rerank_device_flops)
        # everything but the link: HBM, the device's and the host's compute, host DRAM, NVMe
        # (overlapped: the slowest of them; serial: their sum, which the link's time adds to)
        ops = flash_layer_ops(traffic)
        t_rest, _ = step_time(
            hw, a, hbm=hbm, flops=flops, host=b * traffic.host_read_bytes,
            host_flops=b * traffic.host_flops, disk=b * traffic.disk_bytes,
            dispatch=ops.seconds(a, m.layers), waits=ops.waits > 0,
        )  # fmt: skip
        if t_rest < t_max:  # else HBM, NVMe or compute (device or host) alone already miss the target
            need = (t_max if a.overlap else t_max - t_rest) * hw.link_bytes_per_s / b
    return {
        "throughput_ratio_at_largest_batch": ratio_fill,
        "throughput_ratio_target": TARGET_THROUGHPUT_RATIO,
        "throughput_target_met": ratio_fill >= TARGET_THROUGHPUT_RATIO,
        "batch1_speed_ratio": ratio_b1,
        "batch1_target_met": ratio_b1 >= 1.0,
        "link_bytes_per_seq_step_for_target": need,
    }


def to_dict(hw: Hardware, a: Assumptions, m: ModelCost, rows: list[Row], tgt: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "label": "modelled, not measured",
        "hardware": asdict(hw),
        "assumptions": asdict(a),
        "model_cost": asdict(m),
        "rows": {r.method: r.to_dict() for r in rows},
    }
    if tgt is not None:
        out["targets"] = tgt
    return out
