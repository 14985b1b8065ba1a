"""A griffe extension used by mkdocs.yml for the API reference pages.

The docstrings are written for Python's help() with reST roles (:func:`connect`,
:class:`~cgx_ucx.errors.PeerLostError`); this turns each role into a Markdown code span
(`connect`, `PeerLostError`: a leading ``~`` keeps the last name only) so the pages do
not show the role markup.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _code_span(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    if tilde:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class RstRoles(griffe.Extension):
    """Rewrites the reST roles of every docstring as Markdown code spans."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code_span, obj.docstring.value)
