"""The shapes of jaxamp's messages: a bad value named with the valid choices; a guide linked."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Where the guides are read outside the repository (a message cites them by this link).
DOCS_URL = "https://github.com/jaxamp/jaxamp/blob/main/docs"


def guide(page: str, section: str = "") -> str:
    """The link to a guide page (and a section's anchor) that messages and docstrings cite.

    Examples:
      >>> guide("fp8.md", "limits")
      'https://github.com/jaxamp/jaxamp/blob/main/docs/guides/fp8.md#limits'
    """
    return f"{DOCS_URL}/guides/{page}" + (f"#{section}" if section else "")


def valid_choices(choices: Iterable[Any], *, quote: bool = False) -> str:
    """``"Valid choices: a, b."``: the sentence every such error ends with."""
    return f"Valid choices: {', '.join(repr(c) if quote else str(c) for c in choices)}."


def invalid_choice(
    what: str, value: Any, choices: Iterable[Any], *, quote: bool = False, why: str = ""
) -> ValueError:
    """A ``ValueError`` that names the bad ``value`` and lists the valid ``choices``.

    Args:
      what: what the value is, e.g. ``"matmul form"``.
      value: the value given.
      choices: the valid values, in the order to list them.
      quote: list the choices with ``repr`` (for strings that need quotes).
      why: the sentence before the choices (default: ``"Unknown <what> <value>."``).

    Returns:
      The error, to ``raise``.

    Examples:
      >>> print(invalid_choice("rounding", "up", ("nearest", "stochastic")))
      Unknown rounding 'up'. Valid choices: nearest, stochastic.
    """
    why = why or f"Unknown {what} {value!r}."
    return ValueError(f"{why} {valid_choices(choices, quote=quote)}")
