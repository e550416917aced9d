"""Regexes from untrusted adapter configs, compiled into matchers that run in linear time.

PEFT configs hold regexes (``target_modules`` as a string, ``rank_pattern`` / ``alpha_pattern`` keys,
``layers_pattern``, ``exclude_modules``) that PEFT matches with Python's backtracking ``re``, with the GIL
held: one pattern such as ``(?:.|.){26}X`` costs 2^26 steps per module name. lora_pin checks each pattern
with Python's own parser (it accepts what PEFT accepts, no more), then has the Rust core compile a field's
patterns once into a :class:`~lora_pin._core.PatternSet`: automata that never backtrack, so a module key
costs time linear in its length whatever the patterns, and one pass over it finds every pattern it
matches. Python syntax that engine lacks or would read differently (look-around, back-references,
possessive quantifiers, ...) is refused, naming the construct; the rules are in ``rust/core/src/patterns.rs``.

Limits, each named in its error: a pattern has at most :data:`MAX_PATTERN_CHARS` characters, and a config
at most :data:`MAX_PATTERN_ENTRIES` entries in its pattern fields and lists together.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Literal

from lora_pin._core import PatternSet
from lora_pin.errors import AdapterLoadError

__all__ = ["MAX_PATTERN_CHARS", "MAX_PATTERN_ENTRIES", "compile_patterns"]

MAX_PATTERN_CHARS = 1024
# Entries of rank_pattern, alpha_pattern, and the target_modules, exclude_modules, layers_pattern and
# layers_to_transform lists together. Tools that write one rank_pattern and one alpha_pattern entry per
# module give 2 x 560 = 1,120 for an 80-layer model with seven linears per layer; 4,096 leaves room for
# that and bounds the work a config can ask for: a set of 4,096 patterns compiles and matches a tiny
# Llama's modules in well under a second (BENCHMARKS.md).
MAX_PATTERN_ENTRIES = 4096


def compile_patterns(
    context: str,
    patterns: Sequence[str],
    labels: Sequence[str],
    *,
    peft_forms: Sequence[str],
    anchoring: Literal["start", "full", "dotted_suffix"],
) -> PatternSet:
    r"""Compile a field's ``patterns`` into one :class:`~lora_pin._core.PatternSet` applied as ``anchoring``
    says, after checking that Python's ``re`` compiles ``peft_forms[i]``, the regex PEFT builds from
    ``patterns[i]`` (the pattern itself, or embedded as in ``(.*\.)?({key})$``), as PEFT would.
    ``context`` (adapter, file and field) and ``labels[i]`` name a refused pattern in the error.

    Raises:
        AdapterLoadError: a pattern is longer than :data:`MAX_PATTERN_CHARS`, holds a lone surrogate, is
            not a regex Python's ``re`` compiles, uses a construct the linear-time matcher lacks or reads
            differently (named), or the field's patterns together compile past the core's size limit.
    """
    for pattern, form, label in zip(patterns, peft_forms, labels, strict=True):
        if len(pattern) > MAX_PATTERN_CHARS:
            raise AdapterLoadError(
                f"{context} {label} is {len(pattern)} characters long, above the limit "
                f"MAX_PATTERN_CHARS={MAX_PATTERN_CHARS}"
            )
        if not _is_text(pattern):
            raise AdapterLoadError(f"{context} {label} is not valid Unicode (it holds a lone surrogate)")
        try:
            # Nested sets and the like warn (FutureWarning) where they may change meaning one day; the
            # core refuses those, and a warning here must not become an error under -W error.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                re.compile(form)
        except (re.error, RecursionError, OverflowError) as exc:
            raise AdapterLoadError(f"{context} {label} is not a valid regex: {exc}") from None
    return PatternSet(list(patterns), anchoring=anchoring, context=context, labels=list(labels))


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
