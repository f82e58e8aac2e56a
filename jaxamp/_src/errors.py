"""The one shape of jaxamp's errors for a bad value: it names the value and the valid choices."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


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
