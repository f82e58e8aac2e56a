"""The one shape of jaxamp's errors for a bad value: it names the value and the valid choices."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def invalid_choice(
    what: str, value: Any, choices: Iterable[Any], *, quote: bool = False
) -> ValueError:
    """A ``ValueError`` that names the bad ``value`` and lists the valid ``choices``.

    Args:
      what: what the value is, e.g. ``"matmul form"``.
      value: the value given.
      choices: the valid values, in the order to list them.
      quote: list the choices with ``repr`` (for strings that need quotes).

    Returns:
      The error, to ``raise``.

    Examples:
      >>> print(invalid_choice("rounding", "up", ("nearest", "stochastic")))
      Unknown rounding 'up'. Valid choices: nearest, stochastic.
    """
    listed = ", ".join(repr(c) if quote else str(c) for c in choices)
    return ValueError(f"Unknown {what} {value!r}. Valid choices: {listed}.")
