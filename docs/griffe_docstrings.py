"""Griffe extension for the API reference: reads jaxamp's docstrings as Google style.

jaxamp's docstrings are Google style with two Sphinx habits that Markdown does not
understand, which this extension translates when griffe loads them (the source is
left as it is):

- an ``Example:`` section heading (griffe's Google parser knows ``Examples:``; under
  ``Example:`` the doctest lines would be read as Markdown prose), and
- Sphinx roles such as ``:class:`Policy``` or ``:func:`jaxamp.autocast```, rendered as
  plain code.

Once the docstrings say ``Examples:`` and drop the roles this file can go (remove it
from ``mkdocs.yml``'s ``extensions``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`~?([^`]+)`")


def translate(text: str) -> str:
    """The docstring ``text`` with ``Example:`` headings and Sphinx roles translated."""
    text = _EXAMPLE_HEADING.sub(r"\1Examples:", text)
    return _SPHINX_ROLE.sub(r"``\1``", text)


class GoogleDocstrings(griffe.Extension):
    """Translates each docstring once griffe has read it."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = translate(obj.docstring.value)
