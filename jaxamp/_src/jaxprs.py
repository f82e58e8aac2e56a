"""Shared helpers of jaxamp's two jaxpr interpreters (autocast's and the numerics
evaluator's): binding one equation as ``jax.core.eval_jaxpr`` does, and the name scope
that marks code to keep as traced."""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax.extend as jex

# The name scope that marks equations to be evaluated exactly as traced.
FLOAT32_SCOPE = "jaxamp_float32"
FP8_SCOPE = "jaxamp_fp8"  # a float8 GEMM and its scaling, as traced (and named in the HLO)
NO_FP8_SCOPE = "jaxamp_no_fp8"  # a layer an override takes out of float8: the 16-bit rule
BLOCK_SCOPE_PREFIX = "jaxamp_block_"  # inside FP8_SCOPE: a block-scaled GEMM, the format after it

# Evaluating one equation the way ``jax.core.eval_jaxpr`` does needs three things JAX keeps
# private: ``Primitive.get_bind_params`` (turns jaxpr-valued params into what ``bind`` takes;
# it returns ``params`` from jax 0.7 on and ``(subfuns, params)`` before), the equation's
# context (``eqn.ctx.manager``: compute_on, the abstract mesh...) and its name stack (so the
# lowered program keeps the layer names ``jaxamp.precision_report`` shows).


def bind(eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals``, with ``params`` (default: the equation's)."""
    primitive = eqn.primitive
    bind_params = primitive.get_bind_params(eqn.params if params is None else params)
    if isinstance(bind_params, tuple):  # jax < 0.7: (subfuns, params)
        subfuns, bind_params = bind_params
        out = primitive.bind(*subfuns, *invals, **bind_params)
    else:
        out = primitive.bind(*invals, **bind_params)
    return list(out) if primitive.multiple_results else [out]


def eqn_context(eqn: Any) -> contextlib.ExitStack:
    """The name stack and equation context ``jax.core.eval_jaxpr`` evaluates ``eqn`` in."""
    stack = contextlib.ExitStack()
    source_info_util = getattr(jex, "source_info_util", None)
    source_info = getattr(eqn, "source_info", None)
    if source_info_util is not None and source_info is not None:
        with contextlib.suppress(AttributeError, TypeError):
            name_stack = source_info_util.current_name_stack() + source_info.name_stack
            stack.enter_context(
                source_info_util.user_context(source_info.traceback, name_stack=name_stack)
            )
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is not None:
        stack.enter_context(manager)
    return stack


def is_backward_name(name: str) -> bool:
    """Whether a name stack (``jit(f)/transpose(jvp(M))/Dense_0``) is a backward pass's:
    JAX names the equations it transposes ``transpose(...)``."""
    return "transpose(" in name


def in_backward_pass(eqn: Any) -> bool:
    """Whether ``eqn`` belongs to a backward pass traced in the program (``jax.grad``
    called inside the function)."""
    source_info = getattr(eqn, "source_info", None)
    return source_info is not None and is_backward_name(str(source_info.name_stack))


def varying_axes(aval: Any) -> frozenset[str] | None:
    """The mesh axes a value in a ``shard_map`` body varies over, as its type says
    (``None``: its type does not say). jax 0.10 calls the field ``manual_axis_type``
    (``mat`` too); earlier versions ``vma``."""
    manual = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    if manual is not None and hasattr(manual, "varying"):
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)
    return None if vma is None else frozenset(vma)


def _name_stack(eqn: Any) -> str:
    source_info = getattr(eqn, "source_info", None)
    return "" if source_info is None else str(source_info.name_stack)


def in_float32_scope(eqn: Any) -> bool:
    """Whether ``eqn`` was traced in a scope autocast evaluates exactly as traced (code kept
    in float32, or a float8 GEMM with its scaling)."""
    stack = _name_stack(eqn)
    return FLOAT32_SCOPE in stack or FP8_SCOPE in stack


_TRANSFORM = re.compile(r"^(?:\w+\()+|\)+$")  # transpose(jvp(Net)) -> Net


def scope_path(eqn: Any) -> str:
    """The named scopes ``eqn`` runs in, outermost first, joined by ``/``, with the
    wrappers a transformation adds to a name taken off (``jit(f)/transpose(jvp(Net))/dense``
    -> ``f/Net/dense``). Inside ``eqn_context(eqn)`` (as an interpreter evaluates it) they
    include the scopes of the evaluation around it (a call's, a loop's)."""
    source_info_util = getattr(jex, "source_info_util", None)
    stack = _name_stack(eqn)
    if source_info_util is not None:
        with contextlib.suppress(AttributeError, TypeError):
            current = str(source_info_util.current_name_stack())
            stack = current if current.endswith(stack) else f"{current}/{stack}"
    return _stripped(stack)


def _stripped(stack: str) -> str:
    """A name stack with the wrappers transformations add taken off, joined by ``/``."""
    return "/".join(_TRANSFORM.sub("", p) for p in stack.split("/") if p)


def scope_paths(jaxpr: Any, prefix: str = "") -> Iterator[str]:
    """The ``scope_path`` of every equation of ``jaxpr`` and of the jaxprs inside it, each
    below the scopes of the equation that holds it."""
    for eqn in open_jaxpr(jaxpr)[0].eqns:
        path = "/".join(p for p in (prefix, _stripped(_name_stack(eqn))) if p)
        yield path
        for sub in sub_jaxprs(eqn):
            yield from scope_paths(sub, path)


def eqns_in_scopes(jaxpr: Any, patterns: Sequence[str]) -> frozenset[int]:
    """The ids of the equations of ``jaxpr`` (and of the jaxprs inside it) whose scopes,
    below those of the equations holding them (``scope_paths``), lie in a scope one of
    ``patterns`` names (``in_scopes``): a pattern may cross a loop's or a call's body."""
    found: set[int] = set()

    def walk(jaxpr: Any, prefix: str) -> None:
        for eqn in open_jaxpr(jaxpr)[0].eqns:
            path = "/".join(p for p in (prefix, _stripped(_name_stack(eqn))) if p)
            if in_scopes(path, patterns):
                found.add(id(eqn))
            for sub in sub_jaxprs(eqn):
                walk(sub, path)

    if patterns:
        walk(jaxpr, "")
    return frozenset(found)


def in_scopes(path: str, patterns: Sequence[str]) -> bool:
    """Whether a ``scope_path`` lies inside a scope one of ``patterns`` names: a glob
    pattern (``"head"``, ``"block_*"``, ``"encoder/*/attention"``) matched against whole
    scope names anywhere along the path, covering every scope below a match."""
    padded = f"/{path}/"
    return any(fnmatch.fnmatchcase(padded, f"*/{p.strip('/')}/*") for p in patterns)


def in_no_fp8_scope(eqn: Any) -> bool:
    """Whether ``eqn`` was traced in a layer an override takes out of the root's float8
    (its matmuls under the 16-bit rule instead)."""
    return NO_FP8_SCOPE in _name_stack(eqn)


def open_jaxpr(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """``(jaxpr, consts)`` of a ``ClosedJaxpr`` or an open ``Jaxpr``."""
    if isinstance(jaxpr, jex.core.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def sub_jaxprs(eqn: Any, *, hi: bool = False) -> Iterator[Any]:
    """The open jaxprs an equation holds in its params (bodies, branches, rules); with
    ``hi``, also the body a param object holds as ``.jaxpr`` (the ``_prim`` of a "hi"
    primitive: ``RematTraced`` under ``jax_remat3``)."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
                yield open_jaxpr(item)[0]
            elif hi and isinstance(
                getattr(item, "jaxpr", None), (jex.core.ClosedJaxpr, jex.core.Jaxpr)
            ):
                yield open_jaxpr(item.jaxpr)[0]


def equations(jaxpr: Any, *, hi: bool = False) -> Iterator[Any]:
    """Every equation of ``jaxpr`` (closed or open) and of the jaxprs its equations hold,
    in program order, each before those inside it (``hi``: see ``sub_jaxprs``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
      >>> [e.primitive.name for e in equations(closed)]
      ['jit', 'sin', 'mul']
    """
    for eqn in open_jaxpr(jaxpr)[0].eqns:
        yield eqn
        for sub in sub_jaxprs(eqn, hi=hi):
            yield from equations(sub, hi=hi)


def _sub_jaxpr(eqn: Any) -> Any:
    """The jaxpr an equation calls with its own inputs (``pjit``, ``closed_call``,
    ``remat``, ``custom_jvp_call``...), or ``None``."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if sub is not None and hasattr(open_jaxpr(sub)[0], "eqns"):
            inner = open_jaxpr(sub)[0]
            if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
                return inner
    return None


def depends_on_inputs(jaxpr: Any, inputs: Sequence[bool]) -> list[bool]:
    """Per output of ``jaxpr``, whether its value is computed from an input marked in
    ``inputs`` (data dependence, through called jaxprs; any other equation with a
    marked input marks all its outputs). A constant, or an array built from shapes
    alone (``jnp.zeros_like(x)``), depends on nothing."""
    jaxpr = open_jaxpr(jaxpr)[0]
    marked = {v for v, m in zip(jaxpr.invars, inputs, strict=True) if m}
    is_var = lambda v: isinstance(v, jex.core.Var)
    for eqn in jaxpr.eqns:
        flags = [is_var(v) and v in marked for v in eqn.invars]
        if not any(flags):
            continue
        sub = _sub_jaxpr(eqn)
        outs = depends_on_inputs(sub, flags) if sub is not None else [True] * len(eqn.outvars)
        marked.update(v for v, m in zip(eqn.outvars, outs, strict=True) if m)
    return [is_var(v) and v in marked for v in jaxpr.outvars]
