"""flashmem doctor: it measures the folder, reads the config, and keys advice to symptoms."""

from __future__ import annotations

import json

import pytest

from flashmem.cli.main import main
from flashmem.config import FlashMemoryConfig
from flashmem.doctor import SYMPTOMS, diagnose, format_report, probe_io

GiB = 2**30


def _machine(ram_available: int = 64 * GiB, torch_threads: int = 2, cores: int = 2, load: float = 0.5):
    mem = {"ram_total_bytes": 2 * ram_available, "ram_available_bytes": ram_available}
    threads = {"torch_threads": torch_threads, "usable_cores": cores, "cpu_count": cores, "load_average_1m": load}
    return mem, threads, {"kind": "cpu"}


def test_probe_io_measures_block_sized_random_reads(tmp_path) -> None:
    io = probe_io(tmp_path, 65536, file_bytes=4 * 2**20, seconds=0.3)
    assert io["block_bytes"] == 65536 and io["reads"] > 0 and io["iops"] > 0
    assert io["read_mb_per_s"] == pytest.approx(io["iops"] * 65536 / 1e6)
    assert isinstance(io["page_cache_dropped"], bool) and io["page_cache_note"]
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_findings_follow_the_config_and_the_machine(tmp_path) -> None:
    kw = dict(model="smollm2", context=8192, cold_dir=tmp_path, probe_bytes=2**20, probe_seconds=0.2)
    good = diagnose(FlashMemoryConfig(gpu_cache_limit=48, hca_chunk_size=64, lsa_top_k=11, keep_full_layers=[0]),
                    machine_info=_machine(), **kw)  # fmt: skip
    assert {f.symptom for f in good.findings} == set(SYMPTOMS)
    assert not [f for f in good.findings if f.level != "ok" and f.symptom in ("accuracy", "memory")]
    assert good.memory["device_resident_bytes"] < good.memory["full_cache_bytes"]

    bad = diagnose(
        FlashMemoryConfig(
            gpu_cache_limit=16,
            hca_chunk_size=16,
            lsa_top_k=1,
            cold_store="layered",  # (a CPU reads a disk tier of exact blocks by pages: no warning there)
            cold_dir=str(tmp_path),
            prefetch_threads=0,
        ),  # fmt: skip
        machine_info=_machine(ram_available=2**20, torch_threads=8, cores=2, load=7.5),
        **kw,
    )
    text = " | ".join(f"{f.symptom}:{f.level}:{f.finding}" for f in bad.findings)
    assert "accuracy:warn:keep_full_layers is empty" in text
    assert "slow:warn:cold_store layered with prefetch_threads 0" in text
    assert "slow:warn:torch uses 8 threads on 2 usable cores" in text
    assert "slow:warn:load average 7.5 on 2 usable cores" in text
    assert not [f for f in good.findings if "load average" in f.finding]
    assert "memory:bad:device-resident KV" in text  # 1 MiB of RAM cannot hold it
    attends = next(f for f in bad.findings if "exactly" in f.finding)
    assert attends.level == "warn" and attends.number == pytest.approx((4 + 16 + 16) / 8192, abs=1e-4)
    assert "Out of memory:" in format_report(bad)


def test_cli_json_and_bad_folder(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as ex:
        main(["doctor", "--cold-dir", str(tmp_path), "--probe-mib", "1", "--context", "4K", "--json"])
    assert ex.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["context"] == 4096 and out["io"]["folder"] == str(tmp_path)
    assert {f["symptom"] for f in out["findings"]} == set(SYMPTOMS)
    with pytest.raises(SystemExit) as ex:
        main(["doctor", "--cold-dir", str(tmp_path / "missing"), "--probe-mib", "1"])
    assert ex.value.code == 2
    assert "not a folder" in capsys.readouterr().err


def test_no_warning_against_the_recipe(tmp_path) -> None:
    """configs/cpu-small.yaml keeps no layer full and splits pages by the measured layer
    profile: doctor must not tell its user to keep a layer full."""
    from flashmem.cli.run_cmd import DEFAULT_CONFIG

    cfg = FlashMemoryConfig.from_yaml(DEFAULT_CONFIG)
    assert cfg.lsa_layer_shares == "profile" and not cfg.keep_full_layers
    r = diagnose(cfg, model="smollm2", context=8192, cold_dir=tmp_path, probe_bytes=2**20, probe_seconds=0.2,
                 machine_info=_machine())  # fmt: skip
    layers = [f for f in r.findings if "layer" in f.finding and f.symptom == "accuracy"]
    assert layers and all(f.level == "ok" for f in layers)
    assert not [f for f in r.findings if "keep_full_layers" in f.advice]
    # on a CPU with a memory cold tier both tiers are one RAM: about 110% of the full cache
    shared = next(f for f in r.findings if "same RAM" in f.finding)
    assert shared.number == pytest.approx(
        (r.memory["device_resident_bytes"] + r.memory["cold_bytes"]) / r.memory["full_cache_bytes"], abs=1e-4
    )
    assert 1.0 < shared.number < 1.3


@pytest.mark.parametrize("cores,load,threads", [(2, 6.9, 1), (2, 0.3, 2), (2, 1.2, 1), (16, 4.0, 12), (2, None, 2)])
def test_threads_one_per_idle_core(cores, load, threads) -> None:
    from flashmem.doctor import suggest_threads

    assert suggest_threads(cores, load) == threads


def test_warns_when_every_page_is_a_rerank_candidate_on_a_cpu(tmp_path) -> None:
    """At 8K the recipe's re-rank takes every page as a candidate (4 x 200 wanted, 509 sealed):
    a CPU step scores every key, so doctor says the cache saves memory there, not decode time.
    At 32K (2,045 pages, 1,024 candidates) and on a GPU it says nothing of it."""
    kw = dict(model="smollm2", cold_dir=tmp_path, probe_bytes=2**20, probe_seconds=0.2)
    cfg = FlashMemoryConfig(
        gpu_cache_limit=32, lsa_page_tokens=16, lsa_top_k=200, lsa_rerank=4, lsa_rerank_min_pages=256
    )
    short = diagnose(cfg, context=8192, machine_info=_machine(), **kw)
    hit = [f for f in short.findings if "re-rank candidate" in f.finding]
    assert len(hit) == 1 and hit[0].symptom == "slow" and hit[0].level == "warn"
    pages = (8192 - cfg.sink_tokens - 32) // 16
    assert hit[0].number == pages and "lsa_rerank_min_pages" in hit[0].advice
    long = diagnose(cfg.model_copy(update={"lsa_top_k": 256}), context=32768, machine_info=_machine(), **kw)
    assert not [f for f in long.findings if "re-rank candidate" in f.finding]
    mem, threads, _ = _machine()
    gpu = diagnose(cfg, context=8192, machine_info=(mem, threads, {"kind": "cuda"}), **kw)
    assert not [f for f in gpu.findings if "re-rank candidate" in f.finding]


def test_warns_of_a_prefetcher_on_a_cpu_with_a_disk_tier(tmp_path) -> None:
    """A disk tier on a CPU with prefetch threads set by hand gets a memory warning that names
    `prefetch_threads: auto`; with `auto` (the default, none there), with 0, a memory tier, or on a
    GPU, none. Nor does 0 there draw the slow warning a GPU's disk tier without loaders gets."""
    kw = dict(model="smollm2", context=8192, cold_dir=tmp_path, probe_bytes=2**20, probe_seconds=0.2)
    disk = FlashMemoryConfig(cold_store="disk", cold_dir=str(tmp_path))
    assert disk.prefetch_threads == "auto"
    by_hand = disk.model_copy(update={"prefetch_threads": 2})

    def findings(cfg: FlashMemoryConfig, kind: str, symptom: str, words: str) -> list:
        mem, threads, _ = _machine()
        r = diagnose(cfg, machine_info=(mem, threads, {"kind": kind}), **kw)
        return [f for f in r.findings if words in f.finding and f.symptom == symptom and f.level == "warn"]

    def warned(cfg: FlashMemoryConfig, kind: str = "cpu") -> list:
        return findings(cfg, kind, "memory", "prefetch threads")

    hit = warned(by_hand)
    assert len(hit) == 1 and "prefetch_threads: auto" in hit[0].advice and hit[0].number == 2
    assert not warned(disk)
    assert not warned(disk.model_copy(update={"prefetch_threads": 0}))
    assert not warned(FlashMemoryConfig(prefetch_threads=2))
    assert not warned(by_hand, "cuda")
    none = disk.model_copy(update={"prefetch_threads": 0})
    assert not findings(none, "cpu", "slow", "prefetch_threads 0")
    assert len(findings(none, "cuda", "slow", "prefetch_threads 0")) == 1
    assert not findings(disk, "cuda", "slow", "prefetch_threads 0")
