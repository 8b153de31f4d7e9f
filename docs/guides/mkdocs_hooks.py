"""mkdocs hook: drop Sphinx roles (``:class:`X```) that docstrings use, keeping ``X``.

The API reference is rendered from docstrings written for Sphinx-style readers; Markdown
shows the role name as text. Listed in mkdocs.yml (``hooks``) and excluded from the site.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|exc|obj|data):\s*(<code>)~?")


def on_page_content(html: str, **kwargs) -> str:
    """Remove the role prefix in front of each code span of the rendered page."""
    return _ROLE.sub(r"\1", html)
