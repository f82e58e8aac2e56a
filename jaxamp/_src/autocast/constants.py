"""Constants a 16-bit trace rounded to ``inf``, and the values the program wrote."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax.extend as jex
import numpy as np

from jaxamp._src.dtypes import FLOAT32, is_16bit, is_floating

# ``id(literal): its value as written``, for the evaluation in progress.
_WRITTEN: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "jaxamp_written_constants", default=None
)


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    if isinstance(value, jex.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def _equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs its equations hold."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _equations(sub)


def _literals(jaxpr: Any) -> Iterator[tuple[tuple[str, str, int], Any]]:
    """``(key, literal)`` for each floating literal: the key is where the program wrote it
    (its source line, primitive and operand), the same in two traces of one function."""
    summarize = jex.source_info_util.summarize
    for eqn in _equations(jaxpr):
        for index, atom in enumerate(eqn.invars):
            if isinstance(atom, jex.core.Literal) and is_floating(atom.aval.dtype):
                yield (summarize(eqn.source_info), eqn.primitive.name, index), atom


def rounded_to_inf(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds a non-finite 16-bit constant (``x + 1e5`` traced in float16
    holds ``inf``: JAX rounds a Python scalar to the other operand's dtype)."""
    return any(
        is_16bit(atom.aval.dtype) and not np.all(np.isfinite(np.asarray(atom.val, np.float32)))
        for _, atom in _literals(jaxpr)
    )


def written_values(jaxpr: Any, wide_jaxpr: Any) -> dict[int, Any]:
    """The float32 values of ``jaxpr``'s non-finite 16-bit constants, read off
    ``wide_jaxpr`` (the same function traced in float32).

    A constant gets a value only where the wide trace holds one finite value at the
    same source line, primitive and operand, which rounds to the same ``inf``;
    any other constant keeps its traced value (an ``inf`` the program wrote).
    """
    seen: dict[tuple[str, str, int], set[tuple[float, ...]]] = {}
    for key, atom in _literals(wide_jaxpr):
        seen.setdefault(key, set()).add(tuple(np.ravel(np.asarray(atom.val, np.float64))))
    found = {}
    for key, atom in _literals(jaxpr):
        traced = np.asarray(atom.val)
        if not is_16bit(traced.dtype) or np.all(np.isfinite(traced.astype(np.float32))):
            continue
        values = seen.get(key, set())
        if len(values) != 1:
            continue
        (value,) = values
        if len(value) != traced.size:
            continue
        wide = np.asarray(value, FLOAT32).reshape(traced.shape)
        with np.errstate(over="ignore"):
            rounds_to_traced = np.array_equal(wide.astype(traced.dtype), traced)
        if np.all(np.isfinite(wide)) and rounds_to_traced:
            found[id(atom)] = wide
    return found


@contextlib.contextmanager
def evaluating_with(values: dict[int, Any]) -> Iterator[None]:
    """Makes ``written_value`` see ``values`` while the interpreter evaluates."""
    token = _WRITTEN.set({**(_WRITTEN.get() or {}), **values})
    try:
        yield
    finally:
        _WRITTEN.reset(token)


def holds_written(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds a constant evaluated with its written value."""
    written = _WRITTEN.get()
    return bool(written) and any(id(atom) in written for _, atom in _literals(jaxpr))


def written_value(atom: Any) -> Any:
    """The value the program wrote for the literal ``atom``, or ``None`` (as traced)."""
    written = _WRITTEN.get()
    return None if not written else written.get(id(atom))
