"""Tracing a loss and its gradient the way a training step does, for the numerics tools."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxamp._src.autocast.api import autocast
from jaxamp._src.dtypes import is_inexact, is_narrow
from jaxamp._src.flax_policy.nnx import iter_modules
from jaxamp._src.numerics import sources
from jaxamp._src.numerics.sites import LOSS_SCALE_SCOPE
from jaxamp._src.policy import PolicyLike, get_policy, is_policy_spec


class NotALoss(TypeError):
    """``fun`` does not return a floating scalar, so it has no gradient to take.

    Attributes:
      returned: what it returned instead, e.g. ``"float32[4, 3]"``.
    """

    def __init__(self, message: str, returned: str):
        super().__init__(message)
        self.returned = returned


@dataclasses.dataclass
class Traced:
    """``jax.value_and_grad(fun)`` (or ``fun`` alone) as a jaxpr, with its flat arguments.

    Attributes:
      rules: where each ``custom_vjp``'s backward rule is, per call site (traces the
        forward pass on first call, then cached; see ``sources.custom_vjp_rules``).
    """

    jaxpr: Any
    args: list[Any]
    out_tree: Any
    primal_outputs: int | None  # leaves of the value (loss and aux) before the gradient
    rules: Callable[[], dict[Any, str]] | None = None


def _nnx_module(x: Any) -> bool:
    return isinstance(x, nnx.Module)


def layer_scopes(model: Any) -> Any:
    """Gives each submodule of an NNX ``model`` (the model included) a name scope, so
    that its operations carry the layer's path, e.g. ``Model/encoder/layers/0``, as Flax
    Linen's do. A module called inside one of its ancestors' calls opens its path below
    the ancestor's (``layers/0`` in ``Model/encoder``'s scope), the name scopes adding
    up to the path once; called elsewhere it opens its whole path. Changes the classes
    of the modules of ``model`` in place; call it on a model made for the purpose (the
    numerics tools call it on a copy they merge)."""
    root = type(model).__name__
    for path, module in list(iter_modules(model)):
        module.__class__ = _scoped_class(type(module), (root, *(str(p) for p in path)))
    return model


# The path of the module whose call is being traced (its scope is open), innermost.
_CALLING: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "jaxamp_layer_scope", default=None
)


def _scoped_class(cls: type, path: tuple[str, ...]) -> type:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        scoped = type(self)
        # the scope to open: the path below the module being called, when that is an
        # ancestor (its scope holds the path up to it), else the whole path
        caller = _CALLING.get()
        below = caller is not None and path[: len(caller)] == caller
        name = "/".join(path[len(caller) :] if caller is not None and below else path)
        # the module's own class runs its call (jaxamp.nnx's policy wrappers look up the
        # class above their own), inside the scope
        self.__class__ = cls
        token = _CALLING.set(path)
        try:
            with jax.named_scope(name) if name else contextlib.nullcontext():
                return cls.__call__(self, *args, **kwargs)
        finally:
            _CALLING.reset(token)
            self.__class__ = scoped

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})


def under_policy(
    fun: Callable[..., Any], policy: PolicyLike | Callable[..., Any] | None
) -> tuple[Callable[..., Any], str | None]:
    """``fun`` as the numerics tools run it under ``policy``, and how to name the policy.

    ``policy`` is what ``jaxamp.get_policy`` takes (a ``jaxamp.Policy``, a
    ``jmp.Policy`` or a policy string: ``fun`` runs under ``jaxamp.autocast``), the
    mixed-precision version of ``fun`` itself, or ``None`` (``fun`` as it is, and no
    name).
    """
    if policy is None:
        return fun, None
    if is_policy_spec(policy):
        resolved = get_policy(policy)
        return autocast(fun, resolved), str(resolved)
    if callable(policy):
        return policy, getattr(policy, "__name__", "the mixed-precision fun")
    raise TypeError(
        "policy must be a jaxamp.Policy, a jmp.Policy, a policy string or the "
        "mixed-precision version "
        f"of fun, got {type(policy).__name__}: {policy!r}."
    )


def trace(
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    has_aux: bool = False,
    loss_scale: float | None = None,
    grad: bool = True,
) -> Traced:
    """Traces ``jax.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)`` (``fun`` alone
    when ``grad`` is false), the loss multiplied by ``loss_scale`` before differentiating
    as ``jaxamp.scale_loss`` multiplies it (a 16-bit loss cast to float32 first). NNX
    modules among the arguments are split: those at ``argnums`` are differentiated with
    respect to their ``nnx.Param`` variables, and their layers get name scopes.

    Raises:
      NotALoss: with ``grad``, when ``fun`` does not return a floating scalar.
    """
    argnums_tuple = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in argnums_tuple:
        if not (isinstance(i, int) and -len(args) <= i < len(args)):
            raise ValueError(
                f"argnums {argnums!r} does not name a positional argument of the {len(args)} given."
            )
    argnums_tuple = tuple(i % len(args) for i in argnums_tuple)
    split: dict[int, Any] = {}
    pieces, rests = list(args), list[Any]()
    for i, a in enumerate(args):
        if _nnx_module(a):
            graphdef, params, rest = nnx.split(a, nnx.Param, ...)  # type: ignore[misc]
            split[i] = (graphdef, len(rests))
            pieces[i] = params
            rests.append(rest)  # traced too (not differentiated): BatchNorm updates its stats
    n_args = len(pieces)
    pieces += rests

    def merged(*flat: Any) -> Any:
        values, rest_values = list(flat[:n_args]), flat[n_args:]
        for i, (graphdef, r) in split.items():
            # fresh variables (copy=True): ones shared with the split state belong to an
            # outer trace, and a BatchNorm could not update its statistics in them
            values[i] = layer_scopes(nnx.merge(graphdef, values[i], rest_values[r], copy=True))
        return fun(*values, **kwargs)

    def scaled(*values: Any) -> Any:
        out = merged(*values)
        loss, aux = out if has_aux else (out, None)
        if not (
            hasattr(loss, "shape")
            and jnp.shape(loss) == ()
            and is_inexact(getattr(loss, "dtype", None))
        ):
            returned = (
                f"{loss.dtype}{list(jnp.shape(loss))}"
                if hasattr(loss, "shape") and hasattr(loss, "dtype")
                else type(loss).__name__
            )
            raise NotALoss(
                "find_nonfinite, range_report and numerics_diff differentiate fun: it must "
                "return a floating scalar (the loss)"
                + (" and its auxiliary output (has_aux=True)" if has_aux else "")
                + f", got {returned}. Pass grad=False to evaluate the forward pass alone.",
                returned,
            )
        if loss_scale is not None:
            with jax.named_scope(LOSS_SCALE_SCOPE):
                if is_narrow(loss.dtype):  # as jaxamp.scale_loss: float32 first
                    loss = loss.astype(jnp.float32)
                loss = loss * jnp.asarray(loss_scale, jnp.float32).astype(loss.dtype)
        return (loss, aux) if has_aux else loss

    target = jax.value_and_grad(scaled, argnums_tuple, has_aux=has_aux) if grad else merged
    closed, out_shape = jax.make_jaxpr(target, return_shape=True)(*pieces)
    flat_args = jax.tree.leaves(pieces)
    primal = len(jax.tree.leaves(out_shape[0])) if grad else None

    @functools.cache
    def rules() -> dict[Any, str]:
        return sources.custom_vjp_rules(jax.make_jaxpr(merged)(*pieces))

    return Traced(closed, flat_args, jax.tree.structure(out_shape), primal, rules)


NON_SCALAR = "the function returns a non-scalar"


def trace_or_forward(
    tool: str,
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    has_aux: bool,
    loss_scale: Any,
    grad: bool,
) -> tuple[Traced, str]:
    """``trace``, falling back to the forward pass alone, with a warning, where ``fun``
    is not a loss. Returns the trace and why it is forward only (``""``: it is not)."""
    forward_only = "" if grad else "grad=False"
    try:
        traced = trace(
            fun, argnums, args, kwargs, has_aux=has_aux, loss_scale=loss_scale, grad=grad
        )
    except NotALoss as e:
        warnings.warn(
            f"{tool}: forward only: fun returns {e.returned}, not a floating scalar (a "
            "loss), so no gradient was taken and only the forward pass is checked.",
            UserWarning,
            stacklevel=3,
        )
        return trace(fun, argnums, args, kwargs, grad=False), NON_SCALAR
    return traced, forward_only
