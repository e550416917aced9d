"""Config regexes: linear-time matching (``lora_pin._core.PatternSet``), PEFT's answers or a refusal, the
entry limit, and the float32 bounds on alpha and scaling (``lora_pin.weights.config``)."""

from __future__ import annotations

import re
import time
import warnings
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lora_pin._core import PatternSet
from lora_pin.errors import AdapterLoadError
from lora_pin.weights import AdapterConfig
from lora_pin.weights import config as config_module
from lora_pin.weights.config import FLOAT32_MAX, FLOAT32_TINY
from lora_pin.weights.patterns import MAX_PATTERN_CHARS, MAX_PATTERN_ENTRIES

KEY = "model.layers.0.self_attn.q_proj"
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# CPU seconds of the calling thread: each check took seconds to hours of it with Python's backtracking re
# (2^30 ways per module name), and takes milliseconds in linear time. Counted in the thread's own CPU
# time, which other processes on a busy machine do not add to, so the bound holds however loaded it is.
FAST_S = 2.0
EXPONENTIAL = "(?:.|.)" * 30 + "X"
EXPONENTIAL_3 = "(?:.|.|.)" * 19 + "X"


def model_keys(layers: int) -> list[str]:
    """A Llama's linear module keys over ``layers`` layers."""
    groups = ["self_attn"] * 4 + ["mlp"] * 3
    return [f"model.layers.{i}.{g}.{n}" for i in range(layers) for g, n in zip(groups, LINEARS, strict=True)]


def config(**fields: Any) -> AdapterConfig:
    return AdapterConfig.from_mapping(
        "a", "adapter_config.json", {"r": 8, "target_modules": LINEARS} | fields
    )


def timed(fn: Any) -> tuple[Any, float]:
    """``fn()`` and the CPU seconds this thread spent in it (the core matches on the calling thread)."""
    start = time.thread_time()
    result = fn()
    return result, time.thread_time() - start


# ---- the exponential patterns, through each field -----------------------------------------------------


@pytest.mark.parametrize("pattern", [EXPONENTIAL, EXPONENTIAL_3], ids=["2-way", "3-way"])
def test_exponential_target_modules_matches_fast(pattern: str) -> None:
    matched, seconds = timed(lambda: config(target_modules=pattern).targets(KEY))
    assert matched is False and seconds < FAST_S, seconds
    assert config(target_modules=pattern).targets("a" * pattern.count("(?:") + "X")


@pytest.mark.parametrize("pattern", [EXPONENTIAL, EXPONENTIAL_3], ids=["2-way", "3-way"])
def test_exponential_exclude_modules_matches_fast(pattern: str) -> None:
    matched, seconds = timed(lambda: config(exclude_modules=pattern).targets(KEY))
    assert matched is True and seconds < FAST_S, seconds


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_exponential_pattern_key_matches_fast(field: str) -> None:
    c = config(**{field: {EXPONENTIAL: 4, "v_proj": 2}})
    (rank, alpha, unused), seconds = timed(
        lambda: (c.rank_for(KEY), c.alpha_for(KEY), c.unused_pattern_keys(model_keys(2)))
    )
    assert (rank, alpha) == (8, 8.0) and seconds < FAST_S, seconds
    assert unused == [(field, EXPONENTIAL)]


def test_exponential_layers_pattern_matches_fast() -> None:
    # Shorter: PEFT's layer form adds at least four characters, and re gives up at once on a key
    # shorter than a pattern's minimum length.
    c = config(layers_pattern="(?:.|.)" * 24 + "X", layers_to_transform=[0])
    matched, seconds = timed(lambda: [c.targets(k) for k in model_keys(2)])
    # The pattern finds no layer index, so no module is in layer 0 by it (PEFT's rule).
    assert matched == [False] * 14 and seconds < FAST_S, seconds


# ---- constructs the linear-time matcher lacks or reads differently --------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"target_modules": r"^(?!.*vision).*\.q_proj"},
            r"field 'target_modules' '^(?!.*vision).*\\.q_proj' uses look-around",
        ),
        ({"target_modules": r".*(?<=attn)\.q_proj"}, "uses look-around"),
        ({"target_modules": r".*(q)\1_proj"}, r"uses a back-reference (\1)"),
        ({"target_modules": r".*(?P<p>q)(?P=p)"}, "uses a named back-reference"),
        ({"target_modules": r".*(?>q_proj)"}, "uses an atomic group"),
        ({"target_modules": r".*q_proj*+"}, "uses a possessive quantifier"),
        ({"exclude_modules": r"(?=.*mlp).*"}, "field 'exclude_modules' '(?=.*mlp).*' uses look-around"),
        ({"rank_pattern": {"(?!v)q_proj": 4}}, "field 'rank_pattern' key '(?!v)q_proj' uses look-around"),
        ({"alpha_pattern": {r"(q)\1": 4.0}}, "field 'alpha_pattern' key '(q)\\\\1' uses a back-reference"),
        ({"layers_pattern": r"(?=l)layers", "layers_to_transform": [0]}, "field 'layers_pattern'"),
        ({"target_modules": r".*\<q_proj"}, "reads as literal characters"),
        ({"target_modules": r".*[[:alpha:]]"}, "nested class"),
        ({"target_modules": r".*[a&&b]"}, "nested class"),
        ({"target_modules": r"(?x).* q_proj"}, "flag 'x'"),
        ({"target_modules": r"(?i).*Q_PRO\u212a"}, "non-ASCII"),
        ({"rank_pattern": {"(?i)Q_PROJ": 4}}, "field 'rank_pattern' key '(?i)Q_PROJ'"),
        ({"target_modules": "(" * 3}, "is not a valid regex"),
        ({"target_modules": "q" * (MAX_PATTERN_CHARS + 1)}, f"MAX_PATTERN_CHARS={MAX_PATTERN_CHARS}"),
        ({"target_modules": r"(?:.{1000}){1000}"}, "MAX_COMPILED_BYTES"),
    ],
)
def test_patterns_the_matcher_cannot_take_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(AdapterLoadError, match=re.escape(message)) as raised:
        config(**fields)
    assert "adapter 'a' (adapter_config.json)" in str(raised.value)


def test_end_of_string_and_case_flags_match_as_python() -> None:
    c = config(target_modules=r"(?i)MODEL\..*(Q|K)_proj\Z", rank_pattern={r"q_proj\Z": 4, "(?s:.)_proj": 2})
    assert c.targets(KEY) and not c.targets("model.layers.0.self_attn.v_proj")
    assert c.rank_for(KEY) == 4 and c.rank_for("model.layers.0.self_attn.v_proj") == 2


def test_module_keys_outside_printable_ascii_are_refused() -> None:
    c = config(target_modules=".*")
    for key in ["model.layers.0.q_proj\n", "model.é", "a\ud800"]:
        with pytest.raises(AdapterLoadError, match="module key"):
            c.targets(key)
    # A list of names needs no regex: any key is compared as it is.
    assert config().targets("model.é.q_proj")


# ---- the entry limit and many entries -------------------------------------------------------------------


def test_entries_above_the_limit_are_refused_before_any_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    real_compile = config_module.compile_patterns

    def counted(context: str, *args: Any, **kwargs: Any) -> PatternSet:
        compiled.append(context)
        return real_compile(context, *args, **kwargs)

    monkeypatch.setattr(config_module, "compile_patterns", counted)
    keys = {f"q_proj|unused_{i}": 8 for i in range(40_000)}
    with pytest.raises(AdapterLoadError, match=f"40007 entries .* MAX_PATTERN_ENTRIES={MAX_PATTERN_ENTRIES}"):
        config(rank_pattern=keys)
    # Compiling (and re's check of) 40,000 keys took 63.5 s: the count is refused before any of it.
    assert compiled == []
    over = {f"q_proj|unused_{i}": 8 for i in range(MAX_PATTERN_ENTRIES - 6)}
    with pytest.raises(AdapterLoadError, match="4097 entries"):
        config(rank_pattern=over)  # with the seven target_modules names
    with pytest.raises(AdapterLoadError, match="MAX_PATTERN_ENTRIES"):
        config(layers_to_transform=list(range(MAX_PATTERN_ENTRIES)))


def test_many_pattern_keys_match_a_large_model_in_one_pass_each() -> None:
    rank_pattern = {f"{LINEARS[i % 7]}|unused_{i}": 8 for i in range(MAX_PATTERN_ENTRIES - 7)}
    c, compile_s = timed(lambda: config(rank_pattern=rank_pattern))
    keys = model_keys(80)  # 560 modules
    (ranks, unused), match_s = timed(lambda: ([c.rank_for(k) for k in keys], c.unused_pattern_keys(keys)))
    assert ranks == [8] * len(keys) and unused == []
    assert compile_s < FAST_S and match_s < FAST_S, (compile_s, match_s)


# ---- the same answers as Python's re (PEFT's semantics) ------------------------------------------------

_ATOMS = ["a", "b", "A", "_", "0", "7", " ", "-", r"\.", ".", r"\d", r"\w", r"\s", r"\W", r"\D", "[ab]"]
_ATOMS += ["[^a]", "[a-c]", "[A-Z_]", r"[\d.]", r"\-", r"\Z", "^", "$", r"\b", r"\B", r"\A", "[]a]", "[a-]"]
_QUANTIFIERS = ["*", "+", "?", "*?", "+?", "??", "{2}", "{1,2}", "{0,}", "{,2}", "{1,2}?"]


def _grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})"),
        st.tuples(inner, inner).map(lambda t: f"{t[0]}|{t[1]}"),
        inner.map(lambda p: f"({p})"),
        st.tuples(inner, st.sampled_from(_QUANTIFIERS)).map(lambda t: f"(?:{t[0]}){t[1]}"),
        inner.map(lambda p: f"(?i:{p})"),
        inner.map(lambda p: f"(?s:{p})"),
    )


_grammar = st.tuples(
    st.sampled_from(["", "(?i)", "(?s)", "(?m)"]), st.recursive(st.sampled_from(_ATOMS), _grow, max_leaves=8)
)
# Raw text over regex syntax: finds where the two parsers part ways.
_raw = st.text(alphabet=r"ab.\*+?()[]{}|^$-,:=!<>PZzdwsAbB019ix#&~ ", max_size=10)
_keys = st.lists(st.text(alphabet="abAB_07. -", min_size=1, max_size=10), min_size=1, max_size=6)
EQUIV = settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def _python(pattern: str) -> re.Pattern[str] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return re.compile(pattern)
    except (re.error, RecursionError, OverflowError):
        return None


def _matcher(patterns: list[str], anchoring: Any) -> PatternSet | None:
    try:
        return PatternSet(patterns, anchoring=anchoring)
    except AdapterLoadError:
        return None


def _check_same_answers(pattern: str, keys: list[str]) -> None:
    """As ``target_modules`` (``re.fullmatch``) and as a ``rank_pattern`` key (``re.match`` of PEFT's
    form), wherever Python compiles it: the matcher refuses it or answers as ``re`` does for every key."""
    uses = [(pattern, "full", pattern), (rf"(.*\.)?({pattern})$", "dotted_suffix", pattern)]
    compiled_uses = [(_python(form), anchoring, passed) for form, anchoring, passed in uses]
    assume(any(compiled is not None for compiled, _, _ in compiled_uses))
    for compiled, anchoring, passed in compiled_uses:
        if compiled is None:
            continue  # PEFT could not load it either; compile_patterns refuses it first
        matcher = _matcher([passed], anchoring)
        if matcher is None:
            continue  # refused: never a different answer
        for key in [*keys, KEY]:
            want = (compiled.fullmatch if anchoring == "full" else compiled.match)(key) is not None
            assert (matcher.first_match(key) == 0) == want, (compiled.pattern, key, want)


@EQUIV
@given(parts=_grammar, keys=_keys)
def test_matcher_agrees_with_python_re_on_generated_patterns(parts: tuple[str, str], keys: list[str]) -> None:
    _check_same_answers(parts[0] + parts[1], keys)


@EQUIV
@given(pattern=_raw, keys=_keys)
def test_matcher_agrees_with_python_re_on_raw_syntax(pattern: str, keys: list[str]) -> None:
    _check_same_answers(pattern, keys)


@EQUIV
@given(
    parts=_grammar,
    layer=st.integers(0, 12),
    names=st.lists(st.sampled_from(["a", "b", "ab", "7"]), max_size=4),
)
def test_layer_index_agrees_with_python_re(parts: tuple[str, str], layer: int, names: list[str]) -> None:
    form = rf"(?:^|.*?\.){parts[0] + parts[1]}\.(?P<idx>\d+)\."
    compiled = _python(form)
    assume(compiled is not None and "idx" in compiled.groupindex)
    assert compiled is not None
    matcher = _matcher([form], "start")
    assume(matcher is not None)
    assert matcher is not None
    for key in [".".join([*names, str(layer), "q_proj"]), f"model.{'.'.join(names)}.{layer}.{layer + 1}.x"]:
        found = compiled.match(key)
        assert matcher.group(key, "idx") == (None if found is None else found.group("idx")), (form, key)


def test_first_match_is_the_first_pattern_in_file_order() -> None:
    c = config(rank_pattern={"self_attn.q_proj": 4, "q_proj": 2, r"layers\.0\..*": 16}, alpha_pattern={})
    assert c.rank_for(KEY) == 4
    assert c.rank_for("model.layers.1.mlp.q_proj") == 2
    assert c.rank_for("model.layers.0.mlp.up_proj") == 16


# ---- alpha and scaling within float32 -------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1e39, FLOAT32_MAX * 1.0001, 10**400, 1e-39, float("inf")])
def test_alpha_outside_float32_is_refused(alpha: float) -> None:
    with pytest.raises(
        AdapterLoadError, match="field 'lora_alpha' must be a positive number in float32's normal range"
    ):
        config(lora_alpha=alpha)
    with pytest.raises(
        AdapterLoadError, match="field 'alpha_pattern' entry 'q_proj' must be a positive number in float32"
    ):
        config(alpha_pattern={"q_proj": alpha})


def test_scaling_outside_float32_is_refused() -> None:
    c = config(lora_alpha=FLOAT32_TINY * 2, use_rslora=False)
    assert c.scaling_for(KEY, 2) == FLOAT32_TINY
    with pytest.raises(
        AdapterLoadError, match=r"module 'model.layers.0.self_attn.q_proj' has scaling .* / 16\)"
    ):
        c.scaling_for(KEY, 16)
    assert config(lora_alpha=FLOAT32_MAX).scaling_for(KEY, 1) == FLOAT32_MAX
