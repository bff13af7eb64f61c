"""`FlashMemoryConfig.for_budget` and the budget solver: every bad argument is one line
(FlashMemError), model names the calculator knows work, the size cap answers fast, and
the solver's fast ratio is `predicted_ratio` exactly."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashmem.config import FlashMemoryConfig
from flashmem.errors import FlashMemError
from flashmem.recipe import MAX_TOKENS, recipe_keys
from flashmem.sizing.budget import _ratio_of, _sized, budget_config, model_geometry, predicted_ratio


def _one_line(call) -> str:
    with pytest.raises(FlashMemError) as exc:
        call()
    msg = str(exc.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "tokens",
    [0, math.nan, math.inf, -math.inf, "8K", None, -100, 1.5, 8192.0, True, 10**7 * 100, 10**12, [8192], b"8"],
)
def test_bad_tokens_are_one_line(tokens):
    t0 = time.perf_counter()
    msg = _one_line(lambda: FlashMemoryConfig.for_budget(1 / 8, tokens))
    assert msg.startswith(f"tokens: {tokens!r} is not allowed; allowed: an integer from 1 to")
    assert time.perf_counter() - t0 < 1


@pytest.mark.parametrize("budget", [0, -0.1, 1.5, math.nan, math.inf, True, False, "1/8", None, [0.1], 1e309])
def test_bad_budgets_are_one_line(budget):
    msg = _one_line(lambda: FlashMemoryConfig.for_budget(budget, 8192))
    assert msg.startswith(f"budget: {budget!r} is not allowed; allowed: a number with 0 < budget <= 1")


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"group": 0}, "group: 0"),
        ({"group": True}, "group: True"),
        ({"head_dim": 1.5}, "head_dim: 1.5"),
        ({"head_dim": 10**9}, "head_dim: 1000000000"),
        ({"dtype_bytes": 3}, "dtype_bytes: 3"),
        ({"dtype_bytes": math.nan}, "dtype_bytes: nan"),
        ({"variant": "nosuch"}, "variant: 'nosuch' is not known"),
        ({"variant": 3}, "variant: 3"),
        ({"prefetch_threads": 100000}, "prefetch_threads: 100000"),
        ({"gpu_cache_limt": 3}, "unknown key 'gpu_cache_limt'"),
    ],
)
def test_bad_keywords_are_one_line(kw, needle):
    assert needle in _one_line(lambda: FlashMemoryConfig.for_budget(1 / 8, 8192, **kw))


@pytest.mark.parametrize(
    "model, needle",
    [
        ("nosuch-model", "model: unknown model 'nosuch-model'"),
        ("deepseek-v3", "no full-attention layers"),
        (42, "model: a int object is not allowed"),
        (object(), "model: a object object is not allowed"),
        ({"model_type": "llama"}, "model: "),
    ],
)
def test_bad_models_are_one_line(model, needle):
    assert needle in _one_line(lambda: FlashMemoryConfig.for_budget(1 / 8, 8192, model))


def test_model_names_the_calculator_knows():
    """The issue's example, and SmolLM2 by name: its geometry from the built-in facts,
    fp32 as flashmem.load_model loads it; a hub model in the calculator's bf16."""
    t0 = time.perf_counter()
    cfg = FlashMemoryConfig.for_budget(1 / 16, 131072, "llama-3.1-8b")
    assert time.perf_counter() - t0 < 5
    assert model_geometry("llama-3.1-8b") == {"group": 1, "head_dim": 128, "dtype_bytes": 2}
    assert cfg == FlashMemoryConfig.for_budget(1 / 16, 131072, head_dim=128, dtype_bytes=2)
    assert model_geometry("smollm2") == {"group": 3, "head_dim": 64, "dtype_bytes": 4}
    assert model_geometry("SmolLM2-135M") == model_geometry("smollm2")  # the calculator's aliases
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, "smollm2", dtype_bytes=2) == FlashMemoryConfig.for_budget(
        1 / 8, 8192, group=3, head_dim=64, dtype_bytes=2
    )


def test_the_size_cap_answers_fast():
    for tokens in (10**7, MAX_TOKENS):
        t0 = time.perf_counter()
        cfg = FlashMemoryConfig.for_budget(1 / 8, tokens)
        # about 0.1 s on the 2-core machine under load; the bound leaves room for a busier one
        assert time.perf_counter() - t0 < 3, tokens
        assert cfg.lsa_top_k * cfg.page_tokens == 4096  # the cap binds
        assert predicted_ratio(cfg, tokens) <= 1 / 8
    _one_line(lambda: FlashMemoryConfig.for_budget(1 / 8, MAX_TOKENS + 1))


def test_tiny_budgets_give_the_closest_config_not_an_overflow():
    for budget in (1e-300, 5e-324):
        cfg = FlashMemoryConfig.for_budget(budget, 8192)
        assert cfg.gpu_cache_limit == 8 and cfg.lsa_top_k == 0


@st.composite
def _solver_points(draw):
    keys = draw(
        st.sampled_from(
            [
                recipe_keys(1 / 8),
                {**recipe_keys(1 / 8), "working_set_codec": "model"},
                {**recipe_keys(1 / 8), "use_summaries": True, "lsa_scorer": "quest"},
                {**recipe_keys(1 / 8), "rest_entry": True},
                {**recipe_keys(1 / 8), "lsa_page_tokens": None, "lsa_index_dtype": "model", "use_summaries": True},
                {**recipe_keys(1 / 8), "lsa_scorer": "lowrank", "low_rank_dim": 16},
                {**recipe_keys(1 / 8), "lsa_cache_pages": 300},
                {**recipe_keys(1 / 8), "lsa_cache_pages": 5, "working_set_codec": "model"},
                {"lsa_top_k": 1},  # the bare config's layout
            ]
        )
    )
    tokens = draw(st.integers(1, 2**20))
    return (
        FlashMemoryConfig(**keys),
        tokens,
        draw(st.integers(1, tokens + 64)),  # window
        draw(st.integers(0, 4096)),  # pages
        draw(st.integers(0, 32)),  # band blocks
        draw(st.sampled_from([(1, 64, 4), (3, 64, 4), (4, 128, 2), (8, 16, 1)])),
        draw(st.booleans()),  # peak
    )


@settings(max_examples=300, deadline=None)
@given(_solver_points())
def test_fast_ratio_is_predicted_ratio(point):
    base, tokens, w, k, band, (group, head_dim, dtype_bytes), peak = point
    fast = _ratio_of(base, tokens, group, head_dim, dtype_bytes, peak)(w, k, band)
    assert fast == predicted_ratio(_sized(base, w, k, band), tokens, group, head_dim, dtype_bytes, peak)


_any = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-10, 70000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 1),
    st.text(max_size=10),
    st.sampled_from(["smollm2", "llama-3.1-8b", "gemma3-270m", "deepseek-v3", "8K", "default", "nocap"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=_any,
    tokens=_any,
    model=st.one_of(st.none(), _any),
    extra=st.dictionaries(st.sampled_from(["group", "head_dim", "dtype_bytes", "variant", "prefetch_threads"]), _any),
)
def test_any_arguments_give_a_config_or_one_line(budget, tokens, model, extra):
    t0 = time.perf_counter()
    try:
        cfg = FlashMemoryConfig.for_budget(budget, tokens, model, **extra)
    except FlashMemError as exc:
        assert str(exc) and "\n" not in str(exc), repr(str(exc))
    else:
        assert isinstance(cfg, FlashMemoryConfig) and cfg.gpu_cache_limit >= 1
    assert time.perf_counter() - t0 < 10


def test_the_solver_selects_a_page_when_the_budget_allows_one():
    """Gemma3-270m's geometry at 4,050 tokens and 1/32: a 16-token window and no page (1.029x the
    budget) was the fullest config within 3%, over a page and an 8-token window (0.998x); with no
    page the cold tier is never read and a needle cannot be found. Every length here gets a page."""
    from flashmem.sizing.budget import budget_config, predicted_ratio

    geo = {"group": 4, "head_dim": 256, "dtype_bytes": 4}
    for tokens in range(3990, 4140, 10):
        cfg = budget_config(1 / 32, tokens, **geo)
        assert cfg.lsa_top_k >= 1, tokens
        assert predicted_ratio(cfg, tokens, **geo, peak=True) <= 1.03 / 32


def test_an_unreachable_budget_warns_with_what_it_holds():
    """At 2K, 1/32 is 64 tokens a layer: less than the sinks, the window and the open block the
    solver can shape, so it returns its closest config and says so in one warning naming what
    that config holds; a reachable budget gives no warning."""
    import warnings

    from flashmem.errors import BudgetWarning

    with pytest.warns(
        BudgetWarning, match=r"budget 0\.03125 is not reachable at 2048 tokens.*allowed: a budget of at least 0\.0"
    ):
        budget_config(1 / 32, 2048, group=3, head_dim=64, dtype_bytes=4, device_codes=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        budget_config(1 / 32, 4096, group=3, head_dim=64, dtype_bytes=4, device_codes=False)
        budget_config(1 / 16, 2048, group=3, head_dim=64, dtype_bytes=4, device_codes=False)


@pytest.mark.parametrize("window", [32, 512])
def test_a_named_window_stands_and_the_pages_fill_the_budget(window):
    """A caller's gpu_cache_limit is kept (the solver used to overwrite it with its own): the
    pages fill what is left, so a larger window buys fewer of them, a smaller one more, and the
    config still holds about the budget."""
    geo = dict(head_dim=64, group=3, dtype_bytes=4, device_codes=False)
    solved = budget_config(0.125, 8192, **geo)
    named = budget_config(0.125, 8192, gpu_cache_limit=window, **geo)
    assert named.gpu_cache_limit == window != solved.gpu_cache_limit
    assert named.lsa_top_k < solved.lsa_top_k
    smaller = budget_config(0.125, 8192, gpu_cache_limit=window // 2, **geo)
    assert smaller.lsa_top_k > named.lsa_top_k
    assert predicted_ratio(named, 8192, 3, 64, 4, peak=True) == pytest.approx(0.125, rel=0.03)
