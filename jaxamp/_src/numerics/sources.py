"""Where an equation's code is: the ``file:line (function)`` the numerics tools report."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

from jaxamp._src.jaxprs import equations

_LIBRARY = (os.sep + "site-packages" + os.sep, os.sep + "jaxamp" + os.sep + "_src" + os.sep)
# jaxamp.models' code (it lives with the reference experiments): model code, not machinery
_MODELS = os.sep.join(("", "jaxamp", "_src", "compare", "models", ""))


@functools.cache
def _vjp_call_code() -> Any:
    """The code of ``jax.custom_vjp.__call__`` (under its API-boundary wrapper)."""
    import jax

    return getattr(inspect.unwrap(jax.custom_vjp.__call__), "__code__", None)


def source(eqn: Any, rules: Callable[[], dict[Any, str]] | None = None, fallback: str = "") -> str:
    """The first frame of model code (outside JAX, installed packages and jaxamp's
    machinery; jaxamp's reference models count as model code) that traced ``eqn``;
    else ``fallback`` (the source of the call it is inside: the equations of a library
    function JAX traced once, such as ``jnp.where``, keep the traceback of that first
    trace); else the first frame outside JAX. JAX keeps the innermost frames only
    (``jax_traceback_in_locations_limit``), so a deep stack may show library code.

    ``rules``: a (cached) function giving, per call site of a ``custom_vjp``, where its
    backward rule is (``custom_vjp_rules``); an equation of that rule is named
    after it."""
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    if traceback is None:
        return fallback
    if rules is not None:
        site = _bwd_call_site(traceback)
        if site is not None and site in rules():
            return rules()[site]
    frames = _user_frames(traceback)
    own = [f for f in frames if _own_code(f.file_name)]
    if own:
        return _format(own[0])
    return fallback or (_format(frames[0]) if frames else "")


def own_source(eqn: Any) -> str:
    """The first frame of model code that traced ``eqn``, ``""`` when none is."""
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    own = [f for f in _user_frames(traceback) if _own_code(f.file_name)]
    return _format(own[0]) if own else ""


def _user_frames(traceback: Any) -> list[Any]:
    from jax._src import source_info_util  # private: the traceback's frames

    if traceback is None:
        return []
    try:
        return list(source_info_util.user_frames(traceback))
    except Exception:
        return []


def _format(frame: Any) -> str:
    return f"{_relative(frame.file_name)}:{frame.start_line} ({frame.function_name})"


def _own_code(name: str) -> bool:
    return _MODELS in name or not any(part in name for part in _LIBRARY)


def _relative(name: str) -> str:
    with contextlib.suppress(ValueError):  # another drive on Windows
        if os.path.abspath(name).startswith(os.getcwd() + os.sep):
            return os.path.relpath(name)
    return name


def _raw_frames(traceback: Any) -> list[tuple[Any, int]]:
    try:
        codes, lastis = traceback.raw_frames()
    except Exception:
        return []
    return list(zip(codes, lastis, strict=True))


def _call_site(frames: list[tuple[Any, int]], start: int) -> Any:
    """The first frame outside JAX after ``start``: where ``custom_vjp.__call__`` was
    called from (the code object and the instruction, unique per call)."""
    from jax._src import source_info_util

    for code, lasti in frames[start + 1 :]:
        if source_info_util.is_user_filename(code.co_filename):
            return (code, lasti)
    return None


def _vjp_call_index(frames: list[tuple[Any, int]]) -> int | None:
    target = _vjp_call_code()
    for i, (code, _) in enumerate(frames):  # innermost first
        if code is target:
            return i
    return None


# JAX traces a ``custom_vjp``'s backward rule while transposing, under the traceback of the
# forward call, so the rule's equations would point at the caller; they are named after the
# rule instead, which the forward program holds (the ``bwd`` of its ``custom_vjp_call``).
def _bwd_call_site(traceback: Any) -> Any:
    """The ``custom_vjp`` call site of an equation of its backward rule: one traced
    under the call's traceback, with no code of the rule inside ``custom_vjp.__call__``
    (``None`` for any other equation)."""
    from jax._src import source_info_util

    frames = _raw_frames(traceback)
    i = _vjp_call_index(frames)
    if i is None or any(source_info_util.is_user_filename(c.co_filename) for c, _ in frames[:i]):
        return None
    return _call_site(frames, i)


def custom_vjp_rules(jaxpr: Any) -> dict[Any, str]:
    """Per call site (see ``_bwd_call_site``), where the backward rule of each
    ``custom_vjp_call`` of ``jaxpr`` (a forward program, searched through) is."""
    found: dict[Any, str] = {}
    for eqn in equations(jaxpr):
        if eqn.primitive.name != "custom_vjp_call" or "bwd" not in eqn.params:
            continue
        frames = _raw_frames(getattr(eqn.source_info, "traceback", None))
        i = _vjp_call_index(frames)
        where = _rule_location(eqn.params["bwd"])
        if i is not None and where:
            site = _call_site(frames, i)
            if site is not None:
                found.setdefault(site, where)
    return found


def _rule_location(bwd: Any) -> str:
    """``file:line (function)`` of a ``custom_vjp``'s backward rule (a
    ``WrappedFun`` around the user's function), ``""`` when unknown."""
    fun = getattr(bwd, "f", bwd)
    while isinstance(fun, functools.partial):
        fun = fun.func
    fun = inspect.unwrap(fun)
    code = getattr(fun, "__code__", None)
    if code is not None:
        return f"{_relative(code.co_filename)}:{code.co_firstlineno} ({code.co_name})"
    info = getattr(getattr(bwd, "debug_info", None), "func_src_info", None)  # "f at path:line"
    if info and " at " in info:
        name, _, where = info.partition(" at ")
        return f"{_relative(where.rpartition(':')[0])}:{where.rpartition(':')[2]} ({name})"
    return ""
