"""Regexes from untrusted adapter configs, refused when matching them could take exponential time.

PEFT configs hold regexes (``target_modules`` as a string, ``rank_pattern`` / ``alpha_pattern`` keys,
``layers_pattern``, ``exclude_modules``) that are matched against every module name with Python's
backtracking ``re``, which holds the GIL: one pattern such as ``(([a-z.]*)*)*!`` freezes every thread of
the server. Python's ``re`` has no timeout, and an engine without backtracking (RE2) would refuse the
lookaheads real configs use (``^(?!.*vision).*q_proj``), so the patterns are checked instead: the known
sources of catastrophic backtracking are refused, with the reason.

- a variable repetition or an optional part inside a repetition (``(a*)*``, ``(\\w+\\.)+``,
  ``(?:.?){26}``): exponential;
- an alternation inside a repetition (``(a|ab)*``): exponential when the branches overlap;
- more than :data:`MAX_REPEATS` variable quantifiers (``*``, ``+``, ``?``, ``{m,n}``) one after the other
  (``.*.*.*.*!``, ``a?a?a?a?aaaa``): polynomial of that degree (alternatives count their largest).

Module names are short, so what is left costs milliseconds per name at worst.
"""

from __future__ import annotations

import re

try:  # Python 3.11+
    from re import _constants as _c
    from re import _parser
except ImportError:  # Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

__all__ = ["MAX_PATTERN_CHARS", "MAX_REPEATS", "regex_refusal"]

MAX_PATTERN_CHARS = 1024
# Degree 4 lets through the patterns tools write for vision-language finetunes (``.*?(?:language|text)
# .*?(?:self_attn|mlp).*?(?:q_proj|...).*?``); its worst case, ``.*a.*a.*a.*a!`` against a 100-character
# module name, took 20 ms here (degree 5: 400 ms, and 12 s at 200 characters).
MAX_REPEATS = 4

_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}


class _Costly(Exception):
    pass


def regex_refusal(pattern: str) -> str | None:
    """Why ``pattern`` is refused (not a regex, too long, or possibly exponential to match), or None."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"is {len(pattern)} characters long, above {MAX_PATTERN_CHARS}"
    try:
        re.compile(pattern)
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError) as exc:
        return f"is not a valid regex: {exc}"
    try:
        degree = _walk(list(parsed), inside_repeat=False)
    except _Costly as why:
        return f"could take exponential time to match: it has {why}"
    if degree > MAX_REPEATS:
        return (
            f"could take very long to match: it has {degree} variable repetitions in a row "
            f"(at most {MAX_REPEATS})"
        )
    return None


def _walk(items: list[tuple[object, object]], *, inside_repeat: bool) -> int:
    """The degree of the pattern's backtracking: variable quantifiers (``*``, ``+``, ``?``, ``{m,n}``)
    in sequence add up, alternatives take the largest. Raises :class:`_Costly` for a variable quantifier
    or an alternation inside a repetition, where the number of ways to match grows exponentially."""
    degree = 0
    for op, av in items:
        if op in _REPEATS:
            low, high, sub = av  # type: ignore[misc]
            variable = low != high
            if variable and inside_repeat:
                raise _Costly("a variable repetition or optional part inside a repetition")
            degree += int(variable) + _walk(list(sub), inside_repeat=inside_repeat or high > 1)
        elif op is _c.BRANCH:
            if inside_repeat:
                raise _Costly("an alternation inside a repetition")
            degree += max(_walk(list(branch), inside_repeat=False) for branch in av[1])  # type: ignore[index]
        elif op is _c.SUBPATTERN:
            degree += _walk(list(av[-1]), inside_repeat=inside_repeat)  # type: ignore[index]
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            degree += _walk(list(av[1]), inside_repeat=inside_repeat)  # type: ignore[index]
        elif op is _c.GROUPREF_EXISTS:
            degree += max(
                (_walk(list(b), inside_repeat=inside_repeat) for b in av[1:] if b is not None),  # type: ignore[index]
                default=0,
            )
    return degree
