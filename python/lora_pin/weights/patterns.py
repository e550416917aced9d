"""Regexes from untrusted adapter configs, refused when matching them could take exponential time.

PEFT configs hold regexes (``target_modules`` as a string, ``rank_pattern`` / ``alpha_pattern`` keys,
``layers_pattern``, ``exclude_modules``) that are matched against every module name with Python's
backtracking ``re``, which holds the GIL: one pattern such as ``(([a-z.]*)*)*!`` freezes every thread of
the server. Python's ``re`` has no timeout, and an engine without backtracking (RE2) would refuse the
lookaheads real configs use (``^(?!.*vision).*q_proj``), so the patterns are checked instead: the known
sources of catastrophic backtracking are refused, with the reason.

- a repetition inside a repetition (``(a*)*``, ``(\\w+\\.)+``): exponential;
- an alternation inside a repetition (``(a|ab)*``): exponential when the branches overlap;
- more than :data:`MAX_REPEATS` repetitions in one pattern (``.*.*.*.*!``): polynomial of that degree.

Optional parts (``?``, ``{0,1}``) are not repetitions. Module names are short, so what is left is fast.
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
MAX_REPEATS = 3

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
        repeats = _walk(list(parsed), inside_repeat=False)
    except _Costly as why:
        return f"could take exponential time to match: it has {why}"
    if repeats > MAX_REPEATS:
        return f"could take very long to match: it has {repeats} repetitions (at most {MAX_REPEATS})"
    return None


def _walk(items: list[tuple[object, object]], *, inside_repeat: bool) -> int:
    repeats = 0
    for op, av in items:
        if op in _REPEATS:
            _low, high, sub = av  # type: ignore[misc]
            if high > 1:
                if inside_repeat:
                    raise _Costly("a repetition inside a repetition")
                repeats += 1 + _walk(list(sub), inside_repeat=True)
            else:
                repeats += _walk(list(sub), inside_repeat=inside_repeat)
        elif op is _c.BRANCH:
            if inside_repeat:
                raise _Costly("an alternation inside a repetition")
            for branch in av[1]:  # type: ignore[index]
                repeats += _walk(list(branch), inside_repeat=inside_repeat)
        elif op is _c.SUBPATTERN:
            repeats += _walk(list(av[-1]), inside_repeat=inside_repeat)  # type: ignore[index]
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            repeats += _walk(list(av[1]), inside_repeat=inside_repeat)  # type: ignore[index]
        elif op is _c.GROUPREF_EXISTS:
            for branch in av[1:]:  # type: ignore[index]
                if branch is not None:
                    repeats += _walk(list(branch), inside_repeat=inside_repeat)
    return repeats
