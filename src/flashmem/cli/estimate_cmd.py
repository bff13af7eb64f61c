"""`flashmem estimate`: KV-cache memory of a model, full and under FlashMemory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from flashmem.errors import ConfigError
from flashmem.sizing.hardware import Assumptions

HELP = """Estimate the KV cache of a model after --tokens tokens for --batch sequences.

Give --model (a built-in name, a folder with config.json, or a .gguf file: only
its metadata is read) or all of --layers, --kv-heads, --head-dim (and --dtype).

--tokens: a plain integer is exact (1000000 is one million tokens); K and M are
binary: K = 1024, M = 1048576 (128K = 131072, 1M = 1048576).

It is arithmetic, so any size answers at once: --layers 10^21 prints a table (on
purpose: a calculator of what does not fit; docs/guarantees.md).

Sizes print as GB = 10^9 bytes and GiB = 2^30 bytes. With --config FILE (a
FlashMemoryConfig YAML) it also prints the device-resident bytes per tier and
the cold-tier bytes.

The element type is the model's, except for the packaged models (smollm2,
gemma3-270m): flashmem.load_model and flashmem doctor run them in float32, so
estimate assumes float32 too unless --dtype is given.

With --hardware h100|h200|a100|l4 it also prints a hardware model (modelled, not
measured; docs/accelerator.md): decode-step and prefill time, decode tokens/s and
the largest batch that fits in HBM (weights + KV + --activation-gib), for the full
cache in HBM, the full cache offloaded to host and streamed layer by layer, and
flashmem (--config, else the recipe at --budget). flashmem's link bytes per step are
predicted (--new-page-fraction of the selected pages, plus the re-rank's keys with
--rerank-keys link; with the default host they are read and scored by the host, its
DRAM and its FLOPs, --host-tflops) or counted (--traffic FILE.json from
cache.traffic_report(), for that run's own model). --rerank-codec exact|int4|int2|sign
replaces the config's lsa_rerank_codec (what the re-rank reads per candidate key);
--rerank-on-device / --rerank-on-host replaces its lsa_rerank_on_device (a code's
candidates held on the device, in its budget, and scored there: only the codes of new
candidates, --new-candidate-fraction, cross the link; --rerank-codec exact alone puts
the re-rank on the host).
Predicted, it also prints the ratios at the new-page fractions measured by this
project's runs (SmolLM2, Gemma3). Every constant can be overridden.
"""


def estimate_command(
    model: str | None = typer.Option(
        None, "--model", "-m", help="built-in name, HF folder with config.json, or .gguf file"
    ),
    tokens: str = typer.Option(
        ..., "--tokens", "-t", help="tokens per sequence: 131072 (exact), 128K (x1024), 1M (x1048576)"
    ),
    batch: int = typer.Option(1, "--batch", "-b", help="sequences"),
    layers: int | None = typer.Option(None, "--layers", help="attention layers (without --model)"),
    kv_heads: int | None = typer.Option(None, "--kv-heads", help="KV heads per layer (without --model)"),
    head_dim: int | None = typer.Option(None, "--head-dim", help="head dimension (without --model)"),
    dtype: str | None = typer.Option(
        None, "--dtype", help="K/V element type: bfloat16, float16, float32, float8, int8 (overrides the model's)"
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="FlashMemoryConfig YAML: show the device/cold split"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    hardware: str | None = typer.Option(
        None, "--hardware", help="model decode/prefill time and the largest batch on h100, h200, a100 or l4"
    ),
    hbm_gbps: float | None = typer.Option(None, "--hbm-gbps", help="override: HBM bandwidth, GB/s"),
    link_gbps: float | None = typer.Option(None, "--link-gbps", help="override: host-to-device link, GB/s"),
    nvme_gbps: float | None = typer.Option(None, "--nvme-gbps", help="override: NVMe read, GB/s"),
    host_gbps: float | None = typer.Option(None, "--host-gbps", help="override: host DRAM read, GB/s"),
    hbm_gib: float | None = typer.Option(None, "--hbm-gib", help="override: device memory, GiB"),
    tflops: float | None = typer.Option(None, "--tflops", help="override: peak dense bf16 TFLOP/s"),
    host_tflops: float | None = typer.Option(
        None, "--host-tflops", help="override: TFLOP/s the host reaches scoring re-rank candidates (default 1.43)"
    ),
    params: float | None = typer.Option(
        None, "--params", help="parameter count (e.g. 8.03e9); built-ins and HF folders know theirs"
    ),
    traffic: Path | None = typer.Option(
        None, "--traffic", help="cache.traffic_report() JSON: flashmem's counted bytes per step"
    ),
    budget: float | None = typer.Option(
        None, "--budget", help="without --config: flashmem's recipe at this budget (for_budget; default 1/16)"
    ),
    new_page_fraction: float = typer.Option(
        0.4, "--new-page-fraction", help="share of selected pages newly fetched per step (default: ShadowKV's 0.4)"
    ),
    rerank_keys: str = typer.Option(
        "host",
        "--rerank-keys",
        help="where the re-rank reads candidate keys: host (scored next to a memory cold tier, the code on CUDA), "
        "link (copied to the device: disk tiers) or device (a free ranker, nothing counted: a bound; the built "
        "one is --rerank-on-device)",
    ),
    rerank_codec: str | None = typer.Option(
        None,
        "--rerank-codec",
        help="replace the config's lsa_rerank_codec: exact, int4, int2 or sign (bytes the re-rank reads per key)",
    ),
    rerank_on_device: bool | None = typer.Option(
        None,
        "--rerank-on-device/--rerank-on-host",
        help="replace the config's lsa_rerank_on_device: the candidates' codes held on the device (counted in "
        "its bytes) and scored there, or on the host (needs a code: --rerank-codec int4, int2 or sign)",
    ),
    select_every: int | None = typer.Option(
        None,
        "--select-every",
        help="replace the config's lsa_select_every: decode steps one selection serves (1-64; the ranking's "
        "bytes, FLOPs and operators come once in N steps)",
    ),
    static: bool = typer.Option(
        False,
        "--static",
        help="flashmem with decode_step: static (fixed shapes, no host waits: the step a CUDA graph can replay), "
        "laid over the config with what it needs: no page cache, one selection a step, and lsa_rerank 1; with "
        "--rerank-on-device (and a --rerank-codec) it keeps the re-rank by codes held on the device",
    ),
    fetch_share: float | None = typer.Option(
        None,
        "--fetch-share",
        help="with --static: lsa_fetch_share, the share of a step's selected pages (and re-rank candidates' "
        "codes) read a step (0-1; default: every one)",
    ),
    new_candidate_fraction: float | None = typer.Option(
        None,
        "--new-candidate-fraction",
        help="with codes on the device: share of a step's candidates whose codes cross the link "
        "(default: the new-page fraction)",
    ),
    doubt_redo_fraction: float | None = typer.Option(
        None,
        "--doubt-redo-fraction",
        help="with a config's exact_on_doubt: share of decode steps redone exactly, each reading the whole cold "
        "tier (0-1; default 0.12, measured, at most the config's exact_on_doubt_share)",
    ),
    activation_gib: float = typer.Option(2.0, "--activation-gib", help="HBM set aside beyond weights and KV, GiB"),
    flops_fraction: float = typer.Option(0.5, "--flops-fraction", help="fraction of peak FLOP/s reached"),
    no_overlap: bool = typer.Option(False, "--no-overlap", help="add link, HBM and compute times instead of max"),
    dispatch: str | None = typer.Option(
        None,
        "--dispatch",
        help="the host launching each step's operators (eager PyTorch): overlap (the default: queued ahead, the "
        "longer of host and device), serial (flashmem's waits on the device add it: an upper bound) or off "
        "(CUDA graphs' bound)",
    ),
    op_us: float | None = typer.Option(
        None, "--op-us", help="host microseconds per operator that launches a kernel (default 5)"
    ),
    host_gib: float | None = typer.Option(
        None, "--host-gib", help="host memory for the offloaded cache / cold tier, GiB (default: unbounded)"
    ),
) -> None:
    from flashmem.sizing.calculator import estimate

    overrides = dict(hbm_gbps=hbm_gbps, link_gbps=link_gbps, nvme_gbps=nvme_gbps, host_gbps=host_gbps,
                     hbm_gib=hbm_gib, tflops=tflops, host_tflops=host_tflops)  # fmt: skip
    if hardware is None:
        _refuse_hardware_only(
            {**overrides, "traffic": traffic, "params": params, "host_gib": host_gib, "budget": budget,
             "rerank_codec": rerank_codec, "rerank_on_device": rerank_on_device,
             "select_every": select_every, "new_candidate_fraction": new_candidate_fraction,
             "dispatch": dispatch, "op_us": op_us, "static": static or None, "fetch_share": fetch_share,
             "doubt_redo_fraction": doubt_redo_fraction}
        )  # fmt: skip
    dtype_given = dtype
    dtype = assumed_dtype(model, dtype)
    est = estimate(model, tokens=tokens, batch=batch, dtype=dtype, layers=layers, kv_heads=kv_heads,
                   head_dim=head_dim, config=config)  # fmt: skip
    hw_model = None
    if hardware is not None:
        hw, a = _hardware_and_assumptions(
            hardware, overrides, activation_gib, flops_fraction, not no_overlap, new_page_fraction, rerank_keys,
            new_candidate_fraction, dispatch, op_us, doubt_redo_fraction,
        )  # fmt: skip
        hw_model = hardware_model(model, est, hw, a, config=config, budget=budget, params=params, traffic=traffic,
                                  host_gib=host_gib, dims=(layers, kv_heads, head_dim),
                                  rerank_codec=rerank_codec, rerank_on_device=rerank_on_device,
                                  select_every=select_every, static=static, fetch_share=fetch_share)  # fmt: skip
    _emit(est, hw_model, as_json=as_json, dtype_note=dtype_given is None and dtype is not None)


def _refuse_hardware_only(given: dict[str, Any]) -> None:
    """ConfigError naming the first option (keyword name: `host_gib` is --host-gib) that needs --hardware."""
    for name, v in given.items():
        if v is not None:
            flag = "--" + name.replace("_", "-")
            if name == "rerank_on_device" and v is False:
                flag = "--rerank-on-host"
            raise ConfigError(f"{flag}: only with --hardware; allowed: --hardware {'|'.join(HARDWARE_KEYS)}")


def _hardware_and_assumptions(
    hardware: str, overrides: dict[str, float | None], activation_gib: float, flops_fraction: float, overlap: bool,
    new_page_fraction: float, rerank_keys: str, new_candidate_fraction: float | None = None,
    dispatch: str | None = None, op_us: float | None = None, doubt_redo_fraction: float | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """The accelerator (its constants, with the --*-gbps/--hbm-gib/--tflops overrides) and the checked assumptions."""
    from flashmem.sizing import hardware as hwm

    hw = hwm.get_hardware(hardware, **overrides)
    # --dispatch / --op-us not given: the model's defaults (Assumptions)
    given: dict[str, Any] = {} if dispatch is None else {"dispatch": dispatch}
    if op_us is not None:
        given["op_launch_s"] = op_us * 1e-6
    a = hwm.Assumptions(
        activation_bytes=int(activation_gib * hwm.GiB),
        flops_fraction=flops_fraction,
        overlap=overlap,
        new_page_fraction=new_page_fraction,
        rerank_keys=rerank_keys,
        new_candidate_fraction=new_candidate_fraction,
        doubt_redo_fraction=doubt_redo_fraction,
        **given,
    )
    a.check()
    return hw, a


def _emit(est: Any, hw_model: dict[str, Any] | None, *, as_json: bool, dtype_note: bool) -> None:
    """Print the estimate (and the hardware model): one JSON object, or tables."""
    if as_json:
        d = est.to_dict()
        if dtype_note:
            d["dtype_note"] = DTYPE_NOTE
        if hw_model is not None:
            d["hardware_model"] = hw_model
        typer.echo(json.dumps(d, indent=2))
        return
    _print(est)
    if dtype_note:
        typer.echo(DTYPE_NOTE)
    if hw_model is not None:
        _print_hardware(hw_model)


HARDWARE_KEYS = ("h100", "h200", "a100", "l4")
DTYPE_NOTE = "dtype: float32, as flashmem.load_model and flashmem doctor run this packaged model (--dtype to change)"


def assumed_dtype(model: Any, dtype: str | None) -> str | None:
    """The element type to assume: `dtype` if given; float32 for a packaged model (the
    dtype `flashmem.load_model` and `flashmem doctor` use for it); else None (the
    model's own)."""
    if dtype is not None or model is None:
        return dtype
    from flashmem.models.registry import BUILTINS
    from flashmem.sizing.specs import resolve_model

    try:
        spec = resolve_model(model)
    except ConfigError:
        return None  # estimate() names the mistake
    return "float32" if spec.source == "built-in" and spec.name in BUILTINS else None


def hardware_model(
    model: Any,
    est: Any,
    hw: Any,
    a: Any,
    *,
    config: Path | None,
    budget: float | None,
    params: float | None,
    traffic: Path | None,
    host_gib: float | None,
    dims: tuple[int | None, int | None, int | None] = (None, None, None),
    rerank_codec: str | None = None,
    rerank_on_device: bool | None = None,
    select_every: int | None = None,
    static: bool = False,
    fetch_share: float | None = None,
) -> dict[str, Any]:
    """The three rows (full, offloaded, flashmem) and issue 27's targets, as a dict; with
    predicted traffic, also the targets at the measured new-page fractions."""
    from flashmem.sizing import hardware as hwm
    from flashmem.sizing.units import DTYPE_BYTES

    budget, host_bytes = _check_budget_and_host(config, budget, host_gib)
    eb = DTYPE_BYTES[est.dtype]
    arch, head_dim, q_width = _arch_and_widths(model, est, dims)
    n_params = _param_count(params)
    per_seq_kv = est.full_cache_bytes // est.batch
    cost = hwm.model_cost(
        est.model,
        layers=est.layers,
        kv_bytes_per_token=per_seq_kv / est.tokens,
        dtype_bytes=eb,
        q_width=q_width,
        params=n_params,
        arch=arch,
    )
    cfg, cfg_source = _flashmem_config(config, budget, est.tokens, arch, head_dim, eb)
    cfg, cfg_source = _with_rerank_codec(cfg, cfg_source, rerank_codec, traffic, rerank_on_device)
    cfg, cfg_source = _with_select_every(cfg, cfg_source, select_every, traffic)
    cfg, cfg_source = _with_static(cfg, cfg_source, static, fetch_share, traffic, rerank_on_device is True)
    group = arch.heads // arch.kv_heads if arch is not None else 1  # unknown: a lower bound (flops_note)
    flash, tr = _flashmem_traffic(model, est, cfg, dims, traffic, a, group)
    rows_b = [
        hwm.full_row(hw, cost, est.tokens, est.batch, a),
        hwm.offloaded_row(hw, cost, est.tokens, est.batch, a, host_bytes),
        hwm.flashmem_row(hw, cost, est.tokens, est.batch, a, tr, flash.cold_bytes, host_bytes),
    ]
    full1 = hwm.full_row(hw, cost, est.tokens, 1, a)
    flash1 = hwm.flashmem_row(hw, cost, est.tokens, 1, a, tr, flash.cold_bytes, host_bytes)
    out = hwm.to_dict(hw, a, cost, rows_b, hwm.targets(hw, cost, a, full1, flash1, tr))
    out["flashmem_config"] = cfg_source
    out["rerank_codec"] = str(cfg.lsa_rerank_codec)
    out["rerank_on_device"] = bool(cfg.lsa_rerank_on_device)
    out["select_every"] = int(cfg.lsa_select_every)
    out["flashmem_traffic"] = {
        "source": tr.source,
        "link_bytes_per_step": tr.link_bytes,
        "parts": tr.parts,
        "device_read_bytes_per_step": tr.device_read_bytes,
        "host_read_bytes_per_step": tr.host_read_bytes,
        "host_flops_per_step": tr.host_flops,
        "held_code_bytes": tr.held_code_bytes,
        "page_cache_bytes": tr.page_cache_bytes,
        "working_set_merge_bytes_per_step": tr.working_set_merge_bytes,
        "assembly_bytes_per_step": tr.assembly_bytes,
        "device_flops_rerank_per_step": tr.rerank_device_flops,
        "prefill_link_bytes": tr.prefill_link_bytes,
    }
    if traffic is None:  # a run's counted bytes have their own page hits
        measured = []
        for m in hwm.MEASURED_NEW_PAGE_FRACTIONS:
            # a run that counted its candidates gives their fraction too, unless the command names one
            g = a.new_candidate_fraction if a.new_candidate_fraction is not None else m.new_candidate_fraction
            am = replace(a, new_page_fraction=m.new_page_fraction, new_candidate_fraction=g)
            _, trm = _flashmem_traffic(model, est, cfg, dims, None, am, group)
            fm1 = hwm.flashmem_row(hw, cost, est.tokens, 1, am, trm, flash.cold_bytes, host_bytes)
            tg = hwm.targets(hw, cost, am, full1, fm1, trm)
            measured.append({
                "label": m.label, "new_page_fraction": m.new_page_fraction, "source": m.source,
                "new_candidate_fraction": am.candidate_fraction,
                "throughput_ratio_at_largest_batch": tg["throughput_ratio_at_largest_batch"],
                "batch1_speed_ratio": tg["batch1_speed_ratio"], "bound_at_largest": fm1.bound_at_largest,
            })  # fmt: skip
        out["at_measured_new_page_fractions"] = measured
    out["tokens"] = est.tokens
    out["batch"] = est.batch
    out["flops_note"] = (
        "attention FLOPs from the model's query heads"
        if arch is not None
        else "attention FLOPs from KV heads x head_dim (query heads unknown): a lower bound"
    )
    return out


def _param_count(params: float | None) -> int | None:
    """--params as a whole count (None: the model's own)."""
    if params is None:
        return None
    if not params >= 1 or params != int(params):
        raise ConfigError(f"--params: {params!r} is not allowed; allowed: a whole parameter count >= 1")
    return int(params)


def _flashmem_traffic(
    model: Any,
    est: Any,
    cfg: Any,
    dims: tuple[int | None, int | None, int | None],
    traffic: Path | None,
    a: Any,
    group: int = 1,
) -> tuple[Any, Any]:
    """flashmem's estimate for one sequence under `cfg`, and its bytes per step: counted (--traffic)
    or predicted (`group`: query heads per KV head, for the re-rank's host FLOPs)."""
    from flashmem.sizing import hardware as hwm
    from flashmem.sizing.calculator import estimate

    one = estimate(
        model,
        tokens=est.tokens,
        batch=1,
        dtype=est.dtype,
        config=cfg,
        **({} if model is not None else dict(zip(("layers", "kv_heads", "head_dim"), dims, strict=True))),
    )
    flash = one.flashmem
    assert flash is not None
    if traffic is not None:
        report = hwm.load_traffic(traffic)
        return flash, hwm.counted_traffic(report, flash.device_resident_bytes, flash.prompt_kv_bytes, str(traffic))
    head_dim = dims[2]
    if model is not None:
        from flashmem.sizing.budget import model_geometry

        head_dim = model_geometry(model)["head_dim"]
    return flash, hwm.predicted_traffic(flash, cfg, est.tokens, a, head_dim, est.element_bytes, group)


def _check_budget_and_host(
    config: Path | None, budget: float | None, host_gib: float | None
) -> tuple[float, int | None]:
    """The budget to size the recipe at (default 1/16) and the host memory in bytes (None: unbounded)."""
    from flashmem.sizing import hardware as hwm

    if budget is not None and config is not None:
        raise ConfigError("--budget: not allowed together with --config; allowed: one of them")
    budget = 1 / 16 if budget is None else budget
    if not 0 < budget <= 1:
        raise ConfigError(f"--budget: {budget!r} is not allowed; allowed: above 0, up to 1")
    if host_gib is not None and not host_gib > 0:
        raise ConfigError(f"--host-gib: {host_gib!r} is not allowed; allowed: a number > 0")
    return budget, int(host_gib * hwm.GiB) if host_gib is not None else None


def _arch_and_widths(model: Any, est: Any, dims: tuple[int | None, int | None, int | None]) -> tuple[Any, int, int]:
    """The model's architecture (None when unknown), its head_dim and its query width (heads x head_dim)."""
    from flashmem.sizing import hardware as hwm
    from flashmem.sizing.specs import FullAttention, from_dims, resolve_model

    spec = resolve_model(model) if model is not None else from_dims(*dims)  # type: ignore[arg-type]
    arch = hwm.ARCHS.get(est.model)
    if arch is None and spec is not None and spec.source.endswith(".json"):
        arch = hwm.arch_from_config(json.loads(Path(spec.source).read_text(encoding="utf-8")))
    first_full = next((x for x in spec.layers if isinstance(x, FullAttention)), None)
    head_dim = arch.head_dim if arch else (first_full.head_dim if first_full else 128)
    q_width = arch.heads * arch.head_dim if arch else (first_full.kv_heads * head_dim if first_full else head_dim)
    return arch, head_dim, q_width


def _flashmem_config(
    config: Path | None, budget: float, tokens: int, arch: Any, head_dim: int, eb: int
) -> tuple[Any, str]:
    """flashmem's config for the hardware model (--config, else the recipe at `budget`) and where it came from."""
    from flashmem.config import FlashMemoryConfig

    if config is not None:
        return FlashMemoryConfig.from_yaml(config), str(config)
    group = arch.heads // arch.kv_heads if arch else 1
    cfg = FlashMemoryConfig.for_budget(budget, tokens, group=group, head_dim=head_dim, dtype_bytes=eb)
    return cfg, f"the recipe at budget {budget:g} (FlashMemoryConfig.for_budget)"


RERANK_CODECS = ("exact", "int4", "int2", "sign")


def _with_rerank_codec(
    cfg: Any, source: str, codec: str | None, traffic: Path | None, on_device: bool | None = None
) -> tuple[Any, str]:
    """`cfg` with --rerank-codec as its lsa_rerank_codec and --rerank-on-device/--rerank-on-host
    as its lsa_rerank_on_device (checked: one line naming the allowed ones). --rerank-codec
    exact alone turns a config's device-held codes off: exact keys are read where they lie."""
    if codec is None and on_device is None:
        return cfg, source
    flag = "--rerank-codec" if codec is not None else "--rerank-on-device" if on_device else "--rerank-on-host"
    name = str(cfg.lsa_rerank_codec)
    if codec is not None:
        name = codec.strip().lower()
        if name not in RERANK_CODECS:
            raise ConfigError(f"--rerank-codec: {codec!r} is not allowed; allowed: {', '.join(RERANK_CODECS)}")
    if traffic is not None:
        raise ConfigError(
            f"{flag}: not allowed together with --traffic (a run's counted bytes are its own "
            "re-rank's); allowed: one of them"
        )
    if on_device and name == "exact":
        raise ConfigError(
            "--rerank-on-device: holds the candidates' codes on the device, but the re-rank codec is 'exact'; "
            f"allowed: --rerank-codec {', '.join(c for c in RERANK_CODECS if c != 'exact')}"
        )
    held = bool(cfg.lsa_rerank_on_device) if on_device is None else on_device
    if name == "exact" and on_device is None:
        held = False  # exact keys are never held on the device
    update = {"lsa_rerank_codec": name, "lsa_rerank_on_device": held}
    notes = [f"lsa_rerank_codec {name} (--rerank-codec)"] if codec is not None else []
    if held != bool(cfg.lsa_rerank_on_device):
        why = "--rerank-codec exact" if on_device is None else "--rerank-on-device" if on_device else "--rerank-on-host"
        notes.append(f"lsa_rerank_on_device {str(held).lower()} ({why})")
    return cfg.model_copy(update=update), ", ".join([source, *notes])


def _with_select_every(cfg: Any, source: str, every: int | None, traffic: Path | None) -> tuple[Any, str]:
    """`cfg` with --select-every as its lsa_select_every (checked: one line naming what is allowed)."""
    if every is None:
        return cfg, source
    if not 1 <= every <= 64:
        raise ConfigError(f"--select-every: {every} is not allowed; allowed: 1 to 64 decode steps a selection serves")
    if traffic is not None:
        raise ConfigError(
            "--select-every: not allowed together with --traffic (a run's counted bytes are its own "
            "selections'); allowed: one of them"
        )
    return cfg.model_copy(update={"lsa_select_every": every}), f"{source}, lsa_select_every {every} (--select-every)"


def _with_static(
    cfg: Any, source: str, static: bool, share: float | None, traffic: Path | None, keep_rerank: bool = False
) -> tuple[Any, str]:
    """`cfg` with --static (decode_step: static and what it needs) and --fetch-share (checked:
    one line naming what is allowed). keep_rerank (--rerank-on-device given): a re-rank by codes
    held on the device stays, as the static step has it; else lsa_rerank 1."""
    from flashmem.config import FlashMemoryConfig

    if not static:
        if share is not None:
            raise ConfigError("--fetch-share: needs --static (the static step's fixed-size read); allowed: both")
        return cfg, source
    if share is not None and not 0 < share <= 1:
        raise ConfigError(f"--fetch-share: {share} is not allowed; allowed: above 0, up to 1")
    if traffic is not None:
        raise ConfigError(
            "--static: not allowed together with --traffic (a run's counted bytes are its own step's); "
            "allowed: one of them"
        )
    if int(cfg.lsa_select_every) > 1:
        raise ConfigError("--static: one selection a step; allowed: --select-every 1 (or none) with it")
    # a re-rank by codes held on the device stays when asked for (the static step has it)
    coded = (
        keep_rerank and int(cfg.lsa_rerank) > 1 and cfg.lsa_rerank_codec != "exact" and bool(cfg.lsa_rerank_on_device)
    )
    # the static step has no page cache and no rest entry (the recipe's from 1/16 up)
    update: dict[str, Any] = dict(decode_step="static", lsa_fetch_share=share, lsa_cache_pages=0, rest_entry=False)
    if not coded:
        update.update(lsa_rerank=1, lsa_rerank_mirror="none", lsa_rerank_codec="exact", lsa_rerank_on_device=False)
    out = FlashMemoryConfig(**{**cfg.model_dump(), **update})  # one line if the config has what it lacks
    rerank = f"re-ranked by {cfg.lsa_rerank_codec} codes on the device" if coded else "lsa_rerank 1"
    dropped = ", no rest entry" if cfg.rest_entry else ""
    what = f"decode_step static, {rerank}, no page cache{dropped}" + (f", lsa_fetch_share {share:g}" if share else "")
    return out, f"{source}, {what} (--static)"


def _print(est: Any) -> None:
    from rich.console import Console

    con = Console()
    con.print(
        f"[bold]{est.model}[/bold]  ({est.source}; {est.layers} layers, {est.dtype}, " f"{est.element_bytes} B/element)"
    )
    con.print(f"layers: {est.layer_summary}")
    con.print(_summary_table(est))
    if est.flashmem is not None:
        con.print(_tier_table(est.flashmem))
        con.print(
            f"managed layers: {est.flashmem.managed_layers.count}; "
            f"full layers: {est.flashmem.full_layers or 'none'}"
        )
    con.print(_fits_table(est))


def _summary_table(est: Any) -> Any:
    """Bytes per token, the full cache, and flashmem's device and cold bytes (a rich Table)."""
    from rich.table import Table

    from flashmem.sizing.units import fmt_bytes

    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column()
    bpt = est.bytes_per_token
    t.add_row(
        "bytes per token",
        f"{bpt:,}" if isinstance(bpt, int) else f"{bpt:,.3f}",
        "one sequence, each further token at long context",
    )
    if est.fixed_bytes:
        t.add_row("window bytes", f"{est.fixed_bytes:,}", "bounded sliding windows, one sequence")
    t.add_row("tokens x batch", f"{est.tokens:,} x {est.batch}", "")
    t.add_row("full cache", f"{est.full_cache_bytes:,} B", fmt_bytes(est.full_cache_bytes))
    if est.flashmem is not None:
        f = est.flashmem
        t.add_row("flashmem device", f"{f.device_resident_bytes:,} B", fmt_bytes(f.device_resident_bytes))
        if f.prompt_kv_bytes:
            t.add_row(
                "flashmem device, prompt",
                f"{f.prompt_peak_bytes:,} B",
                f"{fmt_bytes(f.prompt_peak_bytes)}, at most: the exact prompt's K/V until the first token",
            )
        t.add_row(f"flashmem cold ({f.cold_codec})", f"{f.cold_bytes:,} B", fmt_bytes(f.cold_bytes))
        if f.cold_layout != "exact":
            t.add_row("cold low-rank", f.cold_layout, "cold_low_rank, low_rank_dim")
        t.add_row("cold bytes per token", f"{f.cold_bytes_per_token:,.1f}", "one sequence")
        if est.full_cache_bytes:
            t.add_row("device / full", f"{f.device_resident_bytes / est.full_cache_bytes:.4f}", "")
    return t


def _tier_table(flash: Any) -> Any:
    """flashmem's device-resident bytes per tier, tiers that hold any (a rich Table)."""
    from rich.table import Table

    from flashmem.sizing.units import fmt_bytes

    tt = Table(title="FlashMemory device-resident bytes per tier (whole batch)")
    tt.add_column("tier")
    tt.add_column("bytes", justify="right")
    tt.add_column("size")
    for k, v in flash.tiers.items():
        if v:
            tt.add_row(k, f"{v:,}", fmt_bytes(v))
    return tt


def _fits_table(est: Any) -> Any:
    """Which accelerators hold the full cache, and flashmem's device bytes (a rich Table)."""
    from rich.table import Table

    ft = Table(title="fits on (KV cache alone, weights not counted)")
    ft.add_column("accelerator")
    ft.add_column("full cache")
    if est.flashmem is not None:
        ft.add_column("flashmem device" + (" (prompt peak)" if est.flashmem.prompt_kv_bytes else ""))
    for name, ok in est.fits.items():
        row = [name, "yes" if ok else "no"]
        if est.flashmem is not None:
            row.append("yes" if est.flashmem.fits[name] else "no")
        ft.add_row(*row)
    return ft


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.3f} GB" if nbytes >= 1e7 else f"{nbytes / 1e6:,.3f} MB"


def _print_hardware(d: dict[str, Any]) -> None:
    from flashmem.sizing.units import fmt_bytes

    hw, a, m = d["hardware"], d["assumptions"], d["model_cost"]
    typer.echo(
        f"hardware model: {hw['name']} (MODELLED, not measured): HBM {hw['hbm_bytes_per_s'] / 1e12:.2f} "
        f"TB/s, {fmt_bytes(hw['hbm_bytes'])}; link {hw['link_bytes_per_s'] / 1e9:.0f} GB/s; NVMe "
        f"{hw['nvme_bytes_per_s'] / 1e9:.0f} GB/s; {hw['peak_flops'] / 1e12:.0f} TFLOPS x {a['flops_fraction']:g}; "
        f"host DRAM {hw['host_bytes_per_s'] / 1e9:.0f} GB/s, host compute {hw['host_flops'] / 1e12:.2f} TFLOP/s"
    )
    typer.echo(
        f"weights {fmt_bytes(m['weight_bytes'])} ({m['params']:,} parameters, {m['params_source']}); "
        f"activation allowance {fmt_bytes(a['activation_bytes'])}; "
        f"{'overlapped (max)' if a['overlap'] else 'serial (sum)'}; host dispatch {a['dispatch']} "
        f"({a['op_launch_s'] * 1e6:g} us an operator); flashmem: {d['flashmem_config']}; "
        f"{d['flops_note']}"
    )
    typer.echo(f"decode and prefill at {d['tokens']:,} tokens per sequence, batch {d['batch']} and the largest:")
    head = ("cache", "HBM/seq", "max batch", "ms/step@b", "tok/s@b", "ms/step@max", "tok/s@max", "bound@max")
    typer.echo(f"{head[0]:<10}" + "".join(f"{h:>12}" for h in head[1:-1]) + f"  {head[-1]:<12}  link/seq/step  prefill")
    for r in d["rows"].values():
        link = r["link_bytes_per_step"] / r["batch"] if r["batch"] else 0.0
        cells = (
            _gb(r["device_bytes_per_seq"]),
            f"{r['largest_batch']:,}",
            f"{r['step_s'] * 1e3:,.2f}" if r["fits"] else "no fit",
            f"{r['tokens_per_s']:,.1f}" if r["fits"] else "-",
            f"{r['step_s_at_largest'] * 1e3:,.1f}" if r["largest_batch"] else "-",
            f"{r['tokens_per_s_at_largest']:,.1f}" if r["largest_batch"] else "-",
        )
        typer.echo(
            f"{r['method']:<10}"
            + "".join(f"{c:>12}" for c in cells)
            + f"  {r['bound_at_largest']:<12}  {_gb(link):>13}  {r['prefill_s']:,.2f} s ({r['prefill_bound']})"
        )
    tr, tg = d["flashmem_traffic"], d["targets"]
    parts = ", ".join(f"{k} {fmt_bytes(int(v))}" for k, v in tr["parts"].items() if v)
    typer.echo(f"flashmem link bytes per sequence and step: {tr['source']}" + (f" ({parts})" if parts else ""))
    if tr.get("held_code_bytes"):
        frac = a["new_candidate_fraction"]
        typer.echo(
            f"re-rank codes held on the device per sequence: {fmt_bytes(int(tr['held_code_bytes']))} (in HBM/seq); "
            f"scored there: {tr['device_flops_rerank_per_step'] / 1e9:,.2f} GFLOP per step; new-candidate "
            f"fraction {a['new_page_fraction'] if frac is None else frac:g}"
        )
    if tr["host_flops_per_step"]:
        typer.echo(
            f"host per sequence and step: reads {fmt_bytes(int(tr['host_read_bytes_per_step']))}, "
            f"{tr['host_flops_per_step'] / 1e9:,.2f} GFLOP (the re-rank's scores)"
        )
    need = tg["link_bytes_per_seq_step_for_target"]
    if tg["throughput_ratio_at_largest_batch"] is None:
        typer.echo(f"issue 27 targets (modelled): not comparable: {tg['note']}")
        return
    typer.echo(
        f"issue 27 targets (modelled, re-rank codec {d['rerank_codec']}{_where(d)}, new-page fraction "
        f"{a['new_page_fraction']:g}): flashmem tok/s at its largest batch / full cache at its largest: "
        f"{tg['throughput_ratio_at_largest_batch']:.2f}x (target >= {tg['throughput_ratio_target']:g}x: "
        f"{'met' if tg['throughput_target_met'] else 'NOT met'}); batch 1, full step / flashmem step: "
        f"{tg['batch1_speed_ratio']:.2f}x (target >= 1: {'met' if tg['batch1_target_met'] else 'NOT met'})"
    )
    typer.echo(
        "link bytes per sequence and step at which the first would be met: "
        + (fmt_bytes(int(need)) if need is not None else "none (HBM, NVMe, host or compute alone miss it)")
    )
    measured = d.get("at_measured_new_page_fractions")
    if measured:
        typer.echo(
            f"at measured new-page fractions (re-rank codec {d['rerank_codec']}{_where(d)}; the default "
            f"{Assumptions.new_page_fraction:g} is ShadowKV's): "
            + "; ".join(
                f"{m['new_page_fraction']:g} ({m['label']}): {m['throughput_ratio_at_largest_batch']:.2f}x at the "
                f"largest batches, {m['batch1_speed_ratio']:.2f}x at batch 1, bound by {m['bound_at_largest']}"
                for m in measured
                if m["throughput_ratio_at_largest_batch"] is not None
            )
        )


def _where(d: dict[str, Any]) -> str:
    """' on the device' when the re-rank's codes are held there."""
    return " on the device" if d.get("rerank_on_device") and d.get("rerank_codec") != "exact" else ""


def register(app: typer.Typer) -> None:
    app.command("estimate", help=HELP)(estimate_command)
