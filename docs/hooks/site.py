"""MkDocs hooks: the site's links work as they do on GitHub, where the pages are also read.

Hooks rather than ``!!python/name`` tags in mkdocs.yml, so that yaml.safe_load reads it.
"""

from __future__ import annotations

import re
from typing import Any

# A page's link to the README, which is not in docs/: on the site the landing page stands in
# (without the #anchor: the landing page is short and has not the README's sections).
README_LINK = re.compile(r"\]\(\.\./README\.md(?:#[^)\s]*)?\)")


def github_slug(value: str, separator: str) -> str:
    """GitHub's heading ids (the pages' #anchors are written for GitHub): lower case,
    punctuation dropped, each space a separator, runs of hyphens kept (``--flag`` stays)."""
    return re.sub(r"[^\w\- ]", "", value.strip().lower()).replace(" ", separator)


def on_config(config: Any) -> Any:
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config


def on_page_markdown(markdown: str, **_: Any) -> str:
    return README_LINK.sub("](index.md)", markdown)
