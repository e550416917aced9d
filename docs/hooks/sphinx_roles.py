"""MkDocs hook: the docstrings cross-reference in Sphinx's roles (``:class:`~lora_pin.x.Y```), which
mkdocstrings renders as the role's text beside the code. Drop the role, and show ``~a.b.C`` as ``C`` as
Sphinx does, so the API reference reads as code names."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(?=<code>)")
TILDE = re.compile(r"<code>~(?:[\w.]+\.)?(\w+)</code>")


def on_page_content(html: str, **_: Any) -> str:
    return TILDE.sub(r"<code>\1</code>", ROLE.sub("", html))
