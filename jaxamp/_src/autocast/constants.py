"""Constants a 16-bit trace rounded to ``inf``, and the values the program wrote."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.extend as jex
import numpy as np

from jaxamp._src.dtypes import FLOAT32, is_16bit, is_floating
from jaxamp._src.jaxprs import equations


def _literals(jaxpr: Any) -> Iterator[tuple[tuple[str, str, int], Any]]:
    """``(key, literal)`` for each floating literal: the key is where the program wrote it
    (its source line, primitive and operand), the same in two traces of one function."""
    summarize = jex.source_info_util.summarize
    for eqn in equations(jaxpr):
        for index, atom in enumerate(eqn.invars):
            if isinstance(atom, jex.core.Literal) and is_floating(
                getattr(atom.aval, "dtype", None)
            ):
                yield (summarize(eqn.source_info), eqn.primitive.name, index), atom


_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
# JAX's own library code that writes reduction identities itself (jax.nn, jax.scipy's
# logsumexp): a call it makes to jax.numpy is not the caller's.
_JAX_LIBRARIES = tuple(
    os.path.join(_JAX_DIR, "_src", name) + os.sep for name in ("nn", "ops", "scipy")
)
# A reduction's identity: ``max(-inf, x)`` and ``min(inf, x)``.
_IDENTITY = {"max": -np.inf, "min": np.inf}


def _identity_written_by_jax(eqn: Any, value: np.ndarray) -> bool:
    """Whether ``value`` is the identity of ``eqn``'s reduction and JAX's own library
    wrote it: ``jax.nn.softmax`` and ``logsumexp`` reduce with ``initial=-inf``, which
    every trace holds as ``-inf``, so a float32 trace would find no other value.

    Read from the equation's traceback, innermost frame first, past JAX's machinery and
    ``jax.numpy`` (whose reductions take the caller's ``initial``): the first frame in
    ``jax.nn``, ``jax.scipy`` or ``jax.ops`` exempts it; one outside JAX
    (``jnp.max(x, initial=-1e5)``, ``-inf`` in float16), or none (the traceback holds
    a few frames only), does not.
    """
    identity = _IDENTITY.get(eqn.primitive.name)
    if identity is None or not np.all(value == identity):
        return False
    traceback = eqn.source_info.traceback
    for frame in traceback.frames if traceback is not None else ():
        if frame.file_name.startswith(_JAX_LIBRARIES):
            return True
        if not frame.file_name.startswith(_JAX_DIR):
            return False
    return False


def rounded_to_inf(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds a non-finite 16-bit constant (``x + 1e5`` traced in float16
    holds ``inf``: JAX rounds a Python scalar to the other operand's dtype), other than
    the ``-inf`` identities JAX's own reductions write (see
    ``_identity_written_by_jax``)."""
    for eqn in equations(jaxpr):
        for atom in eqn.invars:
            if not isinstance(atom, jex.core.Literal) or not is_16bit(
                getattr(atom.aval, "dtype", None)
            ):
                continue
            value = np.asarray(atom.val, np.float32)
            if not np.all(np.isfinite(value)) and not _identity_written_by_jax(eqn, value):
                return True
    return False


def _written_for(written: np.ndarray, traced: np.ndarray) -> bool:
    """Whether the finite float32 ``written`` is what the 16-bit trace rounded to ``traced``."""
    with np.errstate(over="ignore"):
        rounds_to_traced = np.array_equal(written.astype(traced.dtype), traced)
    return bool(np.all(np.isfinite(written))) and rounds_to_traced


def written_values(jaxpr: Any, wide_jaxpr: Any) -> dict[int, Any]:
    """The float32 values of ``jaxpr``'s non-finite 16-bit constants, read off
    ``wide_jaxpr`` (the same function traced in float32).

    Constants are matched by where the program wrote them (source line, primitive and
    operand) and, where one place holds several (a layer used twice, a Python loop), by
    their order there; if the two traces hold a different number at one place, only a
    place with one finite value in the wide trace is read. A constant gets the wide
    value only where that is finite and rounds to the same ``inf``; any other keeps its
    traced value (an ``inf`` the program wrote).
    """
    wide: dict[tuple[str, str, int], list[np.ndarray]] = {}
    for key, atom in _literals(wide_jaxpr):
        wide.setdefault(key, []).append(np.asarray(atom.val, np.float64))
    narrow: dict[tuple[str, str, int], list[Any]] = {}
    for key, atom in _literals(jaxpr):
        narrow.setdefault(key, []).append(atom)
    found = {}
    for key, atoms in narrow.items():
        values = wide.get(key, [])
        if len(values) != len(atoms):  # pair by order only where the counts agree
            distinct = {tuple(np.ravel(v)) for v in values}
            values = [values[0]] * len(atoms) if len(distinct) == 1 else []
        for atom, value in zip(atoms, values, strict=False):
            traced = np.asarray(atom.val)
            if not is_16bit(traced.dtype) or np.all(np.isfinite(traced.astype(np.float32))):
                continue
            if value.size != traced.size:
                continue
            written = np.asarray(value, FLOAT32).reshape(traced.shape)
            if _written_for(written, traced):
                found[id(atom)] = written
    return found


def _const_keys(jaxpr: Any) -> dict[int, tuple[str, str, int]]:
    """``{constvar's position: where the program first uses it}`` (as ``_literals`` keys)."""
    summarize = jex.source_info_util.summarize
    position = {var: i for i, var in enumerate(jaxpr.constvars)}
    keys: dict[int, tuple[str, str, int]] = {}
    for eqn in jaxpr.eqns:
        for index, atom in enumerate(eqn.invars):
            if not isinstance(atom, jex.core.Literal) and atom in position:
                keys.setdefault(
                    position[atom], (summarize(eqn.source_info), eqn.primitive.name, index)
                )
    return keys


def _holds_inf(value: Any) -> bool:
    if not is_16bit(getattr(value, "dtype", None)):  # extended dtypes have no numpy form
        return False
    value = np.asarray(value)
    return is_16bit(value.dtype) and not np.all(np.isfinite(value.astype(np.float32)))


def consts_hold_inf(closed: Any) -> bool:
    """Whether a ``ClosedJaxpr``'s constants hold a 16-bit ``inf`` (an array computed
    outside the function, ``jnp.arange(4) * 1e5``, narrowed to float16 as it was traced)."""
    return any(_holds_inf(c) for c in closed.consts if not isinstance(c, jax.core.Tracer))


def written_consts(closed: Any, wide: Any) -> dict[int, Any]:
    """``{position: float32 value}`` for the constants of ``closed`` that hold a 16-bit
    ``inf`` where ``wide`` (the same function traced in float32) holds, at the constant
    first used at the same place, finite values that round to them."""
    wide_at = {key: i for i, key in _const_keys(wide.jaxpr).items()}
    found = {}
    for i, key in _const_keys(closed.jaxpr).items():
        traced = closed.consts[i]
        if isinstance(traced, jax.core.Tracer) or not _holds_inf(traced) or key not in wide_at:
            continue
        traced = np.asarray(traced)
        written = np.asarray(wide.consts[wide_at[key]])
        if written.shape != traced.shape or not is_floating(written.dtype):
            continue
        written = written.astype(FLOAT32)
        if _written_for(written, traced):
            found[i] = written
    return found


def may_keep_wide(jaxpr: Any, written: Mapping[int, Any]) -> bool:
    """Whether evaluating ``jaxpr`` may keep a value wider than traced: it holds a constant
    evaluated with its value in ``written`` (``written_values``), or narrows a weakly typed
    value to 16 bits."""
    if written and any(id(atom) in written for _, atom in _literals(jaxpr)):
        return True
    return any(
        eqn.primitive.name == "convert_element_type"
        and getattr(eqn.invars[0].aval, "weak_type", False)
        and is_16bit(eqn.params.get("new_dtype"))
        for eqn in equations(jaxpr)
    )
