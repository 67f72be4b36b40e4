"""mkdocs hook: the reStructuredText the package's docstrings use, shown as plain Markdown would show it in the API
reference that mkdocstrings renders from them (it reads docstrings as Markdown, where these are literal text): a
role (:class:`Tuning`, :func:`plan`) becomes plain code, and a paragraph ending in ``::`` (before a literal block)
ends in one colon."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):(?=<code>)")
LITERAL = re.compile(r"(?<=[^:\s]):(?=:</p>)")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return LITERAL.sub("", ROLE.sub("", html))
