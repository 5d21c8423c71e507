"""Griffe extension for the API pages: Sphinx roles in docstrings (``:class:`~tblog_hooks.Histograms```,
``:meth:`step```) become inline code (``Histograms``, ``step()``), as Sphinx would show them.

Loaded by ``mkdocs.yml`` (mkdocstrings' python handler); not part of the package.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?P<role>class|meth|func|data|attr|mod|exc|obj):`(?P<tilde>~?)(?P<target>[^`]+)`")


def plain(match: re.Match[str]) -> str:
    target = match["target"]
    shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
    if match["role"] in ("meth", "func") and not shown.endswith(")"):
        shown += "()"
    return f"`{shown}`"


class SphinxRoles(griffe.Extension):
    """Rewrite the roles in every docstring of the ``tblog_hooks`` package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "tblog_hooks":
            self._rewrite(pkg)

    def _rewrite(self, obj: griffe.Object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(plain, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._rewrite(member)
