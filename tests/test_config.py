"""FlashMemoryConfig: each error is one line naming the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashmem.config import FlashMemoryConfig
from flashmem.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _err(**kw) -> str:
    with pytest.raises(ConfigError) as exc:
        FlashMemoryConfig.from_dict(kw)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_seed_yaml_loads_as_written():
    cfg = FlashMemoryConfig.from_yaml(ROOT / "configs" / "seed.yaml")
    assert cfg.gpu_cache_limit == 32768
    assert cfg.csa_chunk_size == 4
    assert cfg.hca_chunk_size == 128
    assert cfg.prefetch_window == 16384
    assert cfg.keep_full_layers == [58, 59]
    assert cfg.model_fields_set == {
        "gpu_cache_limit",
        "csa_chunk_size",
        "hca_chunk_size",
        "prefetch_window",
        "keep_full_layers",
    }
    # round trip
    assert FlashMemoryConfig.from_yaml_text(cfg.to_yaml()) == cfg


def test_unknown_key_suggests_nearest():
    msg = _err(gpu_cache_limt=10)
    assert "unknown key 'gpu_cache_limt'" in msg
    assert "did you mean 'gpu_cache_limit'?" in msg
    assert "allowed:" in msg and "sink_tokens" in msg


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match="unknown top-level key 'other'"):
        FlashMemoryConfig.from_yaml_text("flash_memory: {}\nother: 1\n")


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("gpu_cache_limit", "big", "an integer"),
        ("gpu_cache_limit", 1.5, "an integer"),
        ("lsa_keep_ratio", "x", "a number"),
        ("persist", "yes", "true or false"),
        ("keep_full_layers", "58", "list of integers"),
        ("cold_codec", "int2", "one of"),
        ("lsa_top_k", "3", "an integer or null"),
    ],
)
def test_wrong_type(key, value, needle):
    msg = _err(**{key: value})
    assert msg.startswith("config: ")  # the source is named first
    assert f"{key}: {value!r} is not allowed; allowed:" in msg
    assert needle in msg


@pytest.mark.parametrize(
    "key,value,bound",
    [
        ("gpu_cache_limit", 0, ">= 1"),
        ("sink_tokens", -1, ">= 0"),
        ("lsa_keep_ratio", 0.0, "> 0.0"),
        ("lsa_keep_ratio", 1.5, "<= 1.0"),
        ("hca_chunk_size", 0, ">= 1"),
    ],
)
def test_out_of_range(key, value, bound):
    msg = _err(**{key: value})
    assert key in msg and bound in msg


def test_hca_not_multiple_of_csa():
    msg = _err(hca_chunk_size=130, csa_chunk_size=4)
    assert "hca_chunk_size: 130 is not a multiple of csa_chunk_size (4)" in msg
    assert "allowed" in msg


def test_disk_store_needs_dir_and_repeated_layers():
    assert "cold_dir" in _err(cold_store="disk")
    assert "repeats a layer" in _err(keep_full_layers=[1, 1])


def test_keep_full_layers_against_model():
    cfg = FlashMemoryConfig(keep_full_layers=[0, -1, -2])
    assert cfg.resolve_full_layers(30) == frozenset({0, 29, 28})
    cfg.check_for_model(30)
    with pytest.raises(ConfigError) as exc:
        FlashMemoryConfig(keep_full_layers=[58, 59]).check_for_model(30)
    assert str(exc.value) == ("keep_full_layers: layer 58 is outside the model's 30 layers; allowed: -30..29")
    with pytest.raises(ConfigError, match="layer -31 is outside"):
        FlashMemoryConfig(keep_full_layers=[-31]).check_for_model(30)
    # seed's layers fit a 61-layer model (DeepSeek-V3)
    FlashMemoryConfig.from_yaml(ROOT / "configs" / "seed.yaml").check_for_model(61)


def test_yaml_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("flash_memory:\n  gpu_cache_limit: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML at line"):
        FlashMemoryConfig.from_yaml(p)
    with pytest.raises(ConfigError, match="no such file"):
        FlashMemoryConfig.from_yaml(tmp_path / "missing.yaml")
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level is list"):
        FlashMemoryConfig.from_yaml(p)


# ------------------------------------------------------------------ property tests
def _check(make):
    try:
        cfg = make()
    except ConfigError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, repr(msg)
        return
    assert isinstance(cfg, FlashMemoryConfig)


_keys = st.one_of(st.sampled_from(list(FlashMemoryConfig.model_fields)), st.text(max_size=12))
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["exact", "int8", "disk", "quest", "memory", "/tmp"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)
_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(st.dictionaries(_keys, _values, max_size=6), st.booleans())
def test_random_dicts_give_config_or_one_line_error(data, wrapped):
    payload = {"flash_memory": data} if wrapped else data
    _check(lambda: FlashMemoryConfig.from_dict(payload))


@_settings
@given(st.dictionaries(_keys, _values, max_size=6))
def test_random_dicts_through_yaml(data):
    try:
        text = yaml.safe_dump({"flash_memory": data})
    except yaml.YAMLError:
        return
    _check(lambda: FlashMemoryConfig.from_yaml_text(text))


@_settings
@given(st.text(max_size=200))
def test_random_yaml_text_gives_config_or_one_line_error(text):
    _check(lambda: FlashMemoryConfig.from_yaml_text(text))


@_settings
@given(
    st.lists(
        st.sampled_from(
            [
                "flash_memory:",
                "  ",
                "gpu_cache_limit:",
                " 4",
                "[",
                "]",
                "{",
                "}",
                "\n",
                "- ",
                ": ",
                "keep_full_layers:",
                "'",
                "&a",
                "*a",
                "!!int",
                "1e3",
                "~",
                ",",
                "hca_chunk_size: 3",
                "\t",
            ]
        ),
        max_size=15,
    )
)
def test_yamlish_fragments(parts):
    _check(lambda: FlashMemoryConfig.from_yaml_text("".join(parts)))


@_settings
@given(st.lists(st.integers(-100, 100), max_size=5), st.integers(1, 80))
def test_keep_full_layers_resolution(layers, n):
    try:
        cfg = FlashMemoryConfig(keep_full_layers=layers)
    except ConfigError:
        assert len(set(layers)) != len(layers)
        return
    inside = all(-n <= i < n for i in layers)
    try:
        got = cfg.resolve_full_layers(n)
    except ConfigError as exc:
        assert not inside and "\n" not in str(exc)
        return
    assert inside and got == frozenset(i % n for i in layers)


# ------------------------------------------------------------------ bounds (issue 30)
@pytest.mark.parametrize(
    "kw, needle",
    [
        (
            {"prefetch_threads": 100000},
            "prefetch_threads: 100000 is not allowed; allowed: an integer 0 to 64, or 'auto'",
        ),
        (
            {"prefetch_threads": "many"},
            "prefetch_threads: 'many' is not allowed; allowed: an integer 0 to 64, or 'auto'",
        ),
        ({"lsa_top_k": 4, "lsa_layer_shares": {0: 1e308}}, "lsa_layer_shares: {0: 1e+308}; allowed:"),
        ({"lsa_top_k": 4, "lsa_layer_shares": {0: float("nan")}}, "finite shares >= 0 and <= 1e+06"),
        ({"cold_store": "disk", "cold_dir": "/tmp/a\x00b"}, "cold_dir: the path contains a NUL byte"),
        ({"cold_dir": "/tmp/x"}, "cold_dir: '/tmp/x' is given, but cold_store 'memory' keeps no files"),
    ],
)
def test_bounds_are_one_line(kw, needle):
    msg = _err(**kw)
    assert needle in msg and "allowed" in msg


def test_huge_shares_never_overflow_the_split():
    cfg = FlashMemoryConfig(lsa_top_k=4, lsa_layer_shares={0: 1e6, 1: 0.0})
    assert cfg.layer_top_k([0, 1, 2]) == {0: 12, 1: 0, 2: 0}


def test_every_problem_is_named():
    """The API's one line names the first problem and the keys of the others; `problems`
    lists each: bad types and ranges, unknown keys, then the combinations the rest break."""
    data = {"gpu_cache_limit": 0, "sink_tokens": -3, "hca_chunk_size": 130, "cold_dir": "/x", "lsa_scorr": "q"}
    problems = FlashMemoryConfig.problems(data)
    assert [p.split(":")[0] for p in problems] == [
        "sink_tokens",
        "gpu_cache_limit",
        "unknown key 'lsa_scorr'; did you mean 'lsa_scorer'? allowed",
        "hca_chunk_size",
        "cold_dir",
    ]
    msg = _err(**data)
    assert msg.startswith("config: sink_tokens: -3 is not allowed")
    assert "(and 4 more: gpu_cache_limit, lsa_scorr, hca_chunk_size, cold_dir;" in msg
    assert FlashMemoryConfig.problems({"lsa_top_k": 3}) == []


def _check_cli(path: Path) -> tuple[int, str, str]:
    import contextlib
    import io

    from flashmem.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main(["config", "check", str(path)])
    return exc.value.code, out.getvalue(), err.getvalue()


def test_config_check_names_every_bad_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(
        "flash_memory:\n  gpu_cache_limit: 0\n  sink_tokens: -3\n  hca_chunk_size: 130\n"
        "  cold_dir: /tmp/x\n  prefetch_threads: 1000\n  lsa_scorr: quest\n"
    )
    code, _, err = _check_cli(p)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    named = [line.removeprefix(f"error: {p}: ").split(":")[0] for line in lines]
    assert named == [
        "sink_tokens",
        "gpu_cache_limit",
        "prefetch_threads",
        "unknown key 'lsa_scorr'; did you mean 'lsa_scorer'? allowed",
        "hca_chunk_size",
        "cold_dir",
        "6 problems",
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _values, max_size=6))
def test_config_check_on_random_files_is_ok_or_one_line_per_problem(data):
    import tempfile

    try:
        text = yaml.safe_dump({"flash_memory": data})
    except yaml.YAMLError:
        return
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(text)
        code, out, err = _check_cli(p)
        expected = FlashMemoryConfig.problems_in_yaml(p)
    assert "Traceback" not in err
    if code == 0:
        assert out.startswith("ok: ") and not expected
    else:
        lines = err.strip().splitlines()
        assert code == 2 and all(line.startswith("error: ") for line in lines)
        assert len(lines) == len(expected) + (len(expected) > 1)
