"""The autocast interpreter's higher-order handlers: calls, remat, control flow, custom rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.autocast.context import CallContext
from jaxamp._src.autocast.interpreter import (
    Env,
    Handler,
    as_traced,
    cast_to_traced,
    eval_jaxpr,
    register_higher_order,
    traced_dtype,
)
from jaxamp._src.autocast.rules import primitive_names
from jaxamp._src.autocast.weights import INLINE_CALLS, carried_activations
from jaxamp._src.dtypes import is_floating, is_narrower, promote, upcast
from jaxamp._src.jaxprs import bind, equations, open_jaxpr

# --- Calls and rematerialization --------------------------------------------------------------


def _inline(key: str) -> Handler:
    """A call (``jit``, ``closed_call``): its body is evaluated in place, with the rules."""

    def evaluate(eqn: Any, env: Env) -> list[Any]:
        if key not in eqn.params:
            return as_traced(eqn, env)
        jaxpr, consts = open_jaxpr(eqn.params[key])
        args = [env.read(a) for a in eqn.invars]
        return eval_jaxpr(jaxpr, consts, args, env.context, env.record)

    return evaluate


for _name, _key in INLINE_CALLS.items():
    register_higher_order(_name)(_inline(_key))


@register_higher_order("checkpoint", "remat2")
def _checkpoint(eqn: Any, env: Env) -> list[Any]:
    return _rematerialized(eqn.params["jaxpr"], eqn.params, eqn, env)


def _rematerialized(closed: Any, params: dict[str, Any], eqn: Any, env: Env) -> list[Any]:
    """``jax.checkpoint`` rebuilt around the body, evaluated with the rules."""
    jaxpr, consts = open_jaxpr(closed)

    outer = [env.read(a) for a in eqn.invars]
    sources = [env.source(v) for v in outer]

    def body(*args: Any) -> Any:
        env.context.enter(outer, args, sources)  # the arguments keep names and kinds
        return eval_jaxpr(jaxpr, consts, args, env.context)

    remat = jax.checkpoint(
        body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )
    return list(remat(*outer))


@register_higher_order("call_hi_primitive")
def _hi_primitive(eqn: Any, env: Env) -> list[Any]:
    """A primitive of JAX's newer "hi" kind (``call_hi_primitive``), whose ``_prim`` says
    what it is. ``jax.checkpoint`` under ``jax_remat3`` is one (``RematTraced``, with
    the body and the policy): rebuilt as ``checkpoint`` is; ``jax.custom_vjp`` under
    ``jax_custom_vjp3`` is another (``CustomVJPTraced``). Any other is refused."""
    prim = eqn.params.get("_prim")
    kind = type(prim).__name__
    params = getattr(prim, "params", None) or {}
    if kind == "RematTraced" and "jaxpr" in params:
        return _rematerialized(params["jaxpr"], params, eqn, env)
    if kind == "CustomVJPTraced" and set(params) >= _CUSTOM_VJP3_PARAMS:
        return _custom_vjp3(prim, eqn, env)
    raise NotImplementedError(
        f"jaxamp cannot evaluate the higher-order primitive {kind!r} (call_hi_primitive, "
        f"jax {jax.__version__}) with its rules; passing it through would leave every "
        "matmul inside in the dtype it was traced in. Call the function that binds it "
        "outside jaxamp.autocast and apply_policy, or report it to jaxamp."
    )


# --- Control flow -----------------------------------------------------------------------------


def _closed_body(closed: Any) -> Callable[..., list[Any]]:
    """A function evaluating a ``ClosedJaxpr`` with the rules: ``body(context, *args)``."""
    jaxpr, consts = open_jaxpr(closed)
    return lambda context, *args: eval_jaxpr(jaxpr, consts, args, context)


def _cast_to(values: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    """Floating ``values`` cast to ``dtypes`` (``None``: left as they are)."""
    return [
        lax.convert_element_type(v, d)
        if d is not None and is_floating(getattr(v, "dtype", None)) and np.dtype(v.dtype) != d
        else v
        for v, d in zip(values, dtypes, strict=True)
    ]


def _promoted_to_outputs(dtypes: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """``dtypes``, each floating one promoted to its ``outs`` dtype where that is wider."""
    return [
        promote(d, o.dtype) if is_narrower(d, o.dtype) else d
        for d, o in zip(dtypes, outs, strict=True)
    ]


def _output_dtypes(
    atoms: Sequence[Any], bodies: Sequence[Any], context: CallContext, *cases: Any
) -> list[Any]:
    """The dtypes control-flow outputs (a loop's carry, a ``cond``'s results) take: their
    traced dtypes, widened where a body holds a constant its 16-bit trace rounded to
    ``inf`` (``a + 1e5`` in float16) and so gives a wider value. ``cases`` are functions
    from the current dtypes and a context (``context`` watched) to the abstract outputs
    of each body."""
    dtypes = [np.dtype(d) if is_floating(d := traced_dtype(a)) else None for a in atoms]
    if not any(context.may_keep_wide(open_jaxpr(b)[0]) for b in bodies):
        return dtypes
    for _ in range(len(dtypes) + 1):  # a loop's carry widens at most once per entry
        wider, watched = dtypes, context.watching()
        for case in cases:
            wider = _promoted_to_outputs(wider, case(wider, watched))
        if not watched.kept.noted or wider == dtypes:
            break
        dtypes = wider
    return dtypes


def _abstract(values: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    return [
        jax.ShapeDtypeStruct(np.shape(v), d if d is not None else jnp.result_type(v))
        for v, d in zip(values, dtypes, strict=True)
    ]


@register_higher_order("cond")
def _cond(eqn: Any, env: Env) -> list[Any]:
    index, *operands = (env.read(a) for a in eqn.invars)
    closed = eqn.params["branches"]
    bodies = [_closed_body(b) for b in closed]
    dtypes = _output_dtypes(
        eqn.outvars,
        closed,
        env.context,
        *[
            lambda _, w, body=body: jax.eval_shape(lambda *a: body(w, *a), *operands)
            for body in bodies
        ],
    )

    def branch(body: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def run(*args: Any) -> list[Any]:
            _entered(env, operands, args)
            return _cast_to(body(env.context, *args), dtypes)

        return run

    return list(lax.switch(index, [branch(body) for body in bodies], *operands))


@register_higher_order("while")
def _while(eqn: Any, env: Env) -> list[Any]:
    p = eqn.params
    values = [env.read(a) for a in eqn.invars]
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = values[:n_cond], values[n_cond : n_cond + n_body]
    carry = values[n_cond + n_body :]
    cond, body, context = _closed_body(p["cond_jaxpr"]), _closed_body(p["body_jaxpr"]), env.context
    dtypes = _output_dtypes(
        eqn.outvars,
        [p["body_jaxpr"]],
        context,
        lambda d, w: jax.eval_shape(lambda c: body(w, *body_consts, *c), _abstract(carry, d)),
    )
    n_body_consts = len(body_consts)
    kinds = _carry_kinds(
        context, p["body_jaxpr"], values[n_cond:], n_body_consts, n_body_consts + len(carry)
    )

    def entered(c: Any) -> Any:
        _entered(env, [*cond_consts, *body_consts], [*cond_consts, *body_consts])
        _entered_carry(env, carry, c, kinds)
        return c

    return list(
        lax.while_loop(
            lambda c: cond(context, *cond_consts, *entered(c))[0],
            lambda c: _cast_to(body(context, *body_consts, *entered(c)), dtypes),
            _cast_to(carry, dtypes),
        )
    )


def _carry_kinds(
    context: CallContext, body: Any, args: Sequence[Any], start: int, stop: int
) -> list[bool] | None:
    """Which carries (``args[start:stop]`` of the loop ``body``'s arguments ``args``) are
    activations, for the formats' GEMMs (``None`` without a format)."""
    weights = context.weights
    if weights is None:
        return None
    kinds = [weights.is_activation(a) for a in args]
    return carried_activations(body, kinds[:start], kinds[start:stop], kinds[stop:])


def _entered_carry(
    env: Env, outer: Sequence[Any], inner: Sequence[Any], kinds: list[bool] | None
) -> None:
    """A loop's carry ``inner``, entered with ``outer``: activations as ``kinds`` says."""
    _entered(env, outer, inner)
    if env.context.weights is not None and kinds is not None:
        env.context.weights.mark(inner, kinds)


def _entered(env: Env, outer: Sequence[Any], inner: Sequence[Any]) -> None:
    """A control-flow body's arguments ``inner`` take the kinds of ``outer`` (weights,
    activations or tables). Unlike a call's, they take no names: delayed scaling names a
    GEMM in a branch or a loop by its computed operands (``·``)."""
    weights = env.context.weights
    if weights is not None:
        weights.enter(outer, inner, [env.source(v) for v in outer])


@register_higher_order("scan")
def _scan(eqn: Any, env: Env) -> list[Any]:
    p = eqn.params
    values = [env.read(a) for a in eqn.invars]
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts, carry, xs = (
        values[:n_consts],
        values[n_consts : n_consts + n_carry],
        values[n_consts + n_carry :],
    )
    body, context = _closed_body(p["jaxpr"]), env.context
    x_slices = [jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)) for x in xs]
    dtypes = _output_dtypes(
        eqn.outvars[:n_carry],
        [p["jaxpr"]],
        context,
        lambda d, w: jax.eval_shape(
            lambda c, x: body(w, *consts, *c, *x)[:n_carry], _abstract(carry, d), x_slices
        ),
    )

    outer_carry, outer_xs = carry, xs
    kinds = _carry_kinds(context, p["jaxpr"], values, n_consts, n_consts + n_carry)

    def step(carry: list[Any], xs: list[Any]) -> tuple[list[Any], list[Any]]:
        _entered(env, consts, consts)  # closed over: a lookup in one marks its source
        _entered_carry(env, outer_carry, carry, kinds)
        _entered(env, outer_xs, xs)
        outs = body(context, *consts, *carry, *xs)
        return _cast_to(outs[:n_carry], dtypes), outs[n_carry:]

    carry, ys = lax.scan(
        step,
        _cast_to(carry, dtypes),
        xs,
        length=p["length"],
        reverse=p.get("reverse", False),
        unroll=p.get("unroll", 1),
    )
    return [*carry, *ys]


# --- shard_map --------------------------------------------------------------------------------


@register_higher_order("shard_map")
def _shard_map(eqn: Any, env: Env) -> list[Any]:
    p = eqn.params
    axis_names = p.get("newly_manual_axes", p.get("manual_axes"))
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None or axis_names is None or not {"in_specs", "out_specs"} <= set(p):
        return as_traced(eqn, env)  # another version's parameters: run it as traced
    jaxpr, consts = open_jaxpr(p["jaxpr"])

    outer = [env.read(a) for a in eqn.invars]
    sources = [env.source(v) for v in outer]

    def body(*args: Any) -> Any:
        env.context.enter(outer, args, sources)  # the arguments keep names and kinds
        return tuple(eval_jaxpr(jaxpr, consts, args, env.context))

    mapped = shard_map(
        body,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=frozenset(axis_names),
        check_vma=p.get("check_vma", True),
    )
    return list(mapped(*outer))


# --- Custom differentiation rules -------------------------------------------------------------


_CUSTOM_VJP3_PARAMS = {"traced", "fwd", "bwd", "symbolic_zeros", "static_argnums", "opt_remat"}


def _ruled_function(fun: Callable[..., Any], context: CallContext) -> Callable[..., Any]:
    """``fun`` (of array pytrees) traced and evaluated with the rules, its outputs cast
    back to their traced dtypes: the same signature, 16-bit inside."""

    def ruled(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        outs = jex.core.jaxpr_as_fun(_with_rules(closed, context))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return ruled


def _custom_vjp3(prim: Any, eqn: Any, env: Env) -> list[Any]:
    """A ``jax.custom_vjp`` function under ``jax_custom_vjp3`` (``CustomVJPTraced``):
    bound again as ``_custom_vjp`` does, with its primal and forward functions evaluated
    with the rules and its backward function as written."""
    context = without_fp8(env.context)
    p = prim.params
    if p["symbolic_zeros"]:
        raise NotImplementedError(
            "jaxamp cannot evaluate a jax.custom_vjp function defined with "
            "symbolic_zeros=True under jax_custom_vjp3 with its rules. Call it outside "
            "jaxamp.autocast and apply_policy, or report it to jaxamp."
        )
    static = frozenset(p["static_argnums"])
    values = [env.read_as(a, traced_dtype(a)) for a in eqn.invars]
    args = jax.tree.unflatten(prim.in_tree, values)
    dynamic = [a for i, a in enumerate(args) if i not in static]
    traced = p["traced"]

    def primal(*dynamic: Any) -> Any:
        ruled = _with_rules(traced.jaxpr, context)
        outs = jex.core.jaxpr_as_fun(ruled)(*jax.tree.leaves(dynamic))
        return jax.tree.unflatten(traced.out_tree, outs)

    def fwd(*full: Any) -> Any:
        def fwd_of_dynamic(*dynamic: Any) -> Any:
            it = iter(dynamic)
            return p["fwd"](*[full[i] if i in static else next(it) for i in range(len(full))])

        return _ruled_function(fwd_of_dynamic, context)(
            *[a for i, a in enumerate(full) if i not in static]
        )

    rebuilt = type(prim)(
        jax.jit(primal).trace(*dynamic),
        fwd,
        p["bwd"],
        prim.in_avals,
        p["symbolic_zeros"],
        p["static_argnums"],
        p["opt_remat"],
    )
    return bind(eqn, values, {**eqn.params, "_prim": rebuilt})


def without_fp8(context: CallContext) -> CallContext:
    """``context`` for the inside of a ``custom_jvp``/``custom_vjp`` function: its GEMMs run
    under the 16-bit matmul rule, not in float8. A float8 GEMM has a custom VJP of its own,
    which JAX can neither differentiate in forward mode (a JVP rule's tangents) nor
    transpose; and a JVP rule runs instead of the body only under differentiation, so
    delayed scaling would find a different set of GEMMs in each."""
    config = context.config
    if config.policy.fp8 is None:
        return context
    policy = dataclasses.replace(config.policy, fp8=None)
    return context.with_config(dataclasses.replace(config, policy=policy))


def _with_rules(closed: Any, context: CallContext) -> Any:
    """``closed`` (a ``ClosedJaxpr``) evaluated with the rules and traced again, its
    outputs cast back to their traced dtypes: the same signature, 16-bit inside."""
    jaxpr, consts = open_jaxpr(closed)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]

    def body(*args: Any) -> Any:
        return cast_to_traced(eval_jaxpr(jaxpr, consts, args, context), jaxpr.outvars)

    return jax.make_jaxpr(body)(*specs)


@register_higher_order("custom_vjp_call", "custom_vjp_call_jaxpr")
def _custom_vjp(eqn: Any, env: Env) -> list[Any]:
    """A ``jax.custom_vjp`` function: bound again with its primal and forward jaxprs
    evaluated with the rules (outputs and residuals cast back to their traced dtypes, so
    the signatures hold) and its backward function as written, in the dtypes it was
    traced in: a custom backward pass is the user's numerics. The forward jaxpr comes
    from ``fwd_jaxpr_thunk`` (a JAX-internal parameter); with other parameters (another
    JAX version) it is refused."""
    context = without_fp8(env.context)
    p = eqn.params
    if not {"call_jaxpr", "fwd_jaxpr_thunk", "bwd", "out_trees"} <= set(p):
        raise NotImplementedError(
            f"jaxamp cannot evaluate {eqn.primitive.name!r} with parameters "
            f"{sorted(p)} (jax {jax.__version__}) with its rules. Call the custom_vjp "
            "function outside jaxamp.autocast and apply_policy, or report it to jaxamp."
        )
    thunk = p["fwd_jaxpr_thunk"]

    def fwd_with_rules(*zeros: Any) -> tuple[Any, Any]:
        fwd = jex.core.ClosedJaxpr(*thunk.call_wrapped(*zeros))
        ruled = _with_rules(fwd, context)
        return ruled.jaxpr, ruled.consts

    params = dict(
        p,
        call_jaxpr=_with_rules(p["call_jaxpr"], context),
        fwd_jaxpr_thunk=jex.linear_util.wrap_init(
            fwd_with_rules, debug_info=getattr(thunk, "debug_info", None)
        ),
    )
    # Its primal and forward jaxprs take the traced dtypes: a 16-bit value the rules made
    # (a matmul's output) goes in as traced.
    return bind(eqn, [env.read_as(a, traced_dtype(a)) for a in eqn.invars], params)


def _zero_tangent(y: Any) -> Any:
    """A zero tangent for ``y``: ``float0`` zeros for an integer or boolean output."""
    if is_floating(getattr(y, "dtype", None)) or jnp.issubdtype(y.dtype, jnp.complexfloating):
        return jnp.zeros_like(y)
    return np.zeros(np.shape(y), jax.dtypes.float0)


def _tangent_like(t: Any, y: Any) -> Any:
    """The rule's tangent in ``y``'s dtype; a ``float0`` tangent (of an integer output) as is."""
    if is_floating(getattr(y, "dtype", None)) and is_floating(getattr(t, "dtype", None)):
        return t.astype(y.dtype)
    return t


_SUMS = primitive_names("reduce_sum_p", "cumsum_p", "cumlogsumexp_p")


@register_higher_order("custom_jvp_call")
def _custom_jvp(eqn: Any, env: Env) -> list[Any]:
    """A ``jax.custom_jvp`` function (``relu``, ``logaddexp`` and so ``softplus``, ``mish``):
    rebuilt with ``jax.custom_jvp`` around its body and its JVP rule, both evaluated with
    the rules, so that the exponentials and logarithms inside run in float32 and a
    16-bit value passes through ``relu`` without a cast. Its outputs take the dtypes the
    evaluated body gives them, and the JVP's primal and tangent outputs are cast to
    those. The JVP rule's jaxpr comes from the equation's ``jvp_jaxpr_fun`` (a
    JAX-internal parameter); with other parameters (another JAX version) the function
    runs as traced."""
    context = without_fp8(env.context)
    p = eqn.params
    if not {"call_jaxpr", "jvp_jaxpr_fun", "num_consts"} <= set(p):
        return as_traced(eqn, env)
    n_consts, jvp_jaxpr_fun = p["num_consts"], p["jvp_jaxpr_fun"]
    body, body_consts = open_jaxpr(p["call_jaxpr"])
    values = [env.read(a) for a in eqn.invars]

    def primal(consts: tuple[Any, ...], args: tuple[Any, ...]) -> list[Any]:
        return eval_jaxpr(body, body_consts, [*consts, *args], context)

    @jax.custom_jvp
    def call(consts: tuple[Any, ...], args: tuple[Any, ...]) -> list[Any]:
        return primal(consts, args)

    @call.defjvp
    def call_jvp(primals: Any, tangents: Any) -> tuple[list[Any], list[Any]]:
        consts, args = primals
        dtypes = [y.dtype for y in jax.eval_shape(primal, consts, args)]
        jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*[False] * len(args))
        # A rule that sums its tangent (softmax's) sums in float32: the transposed sum
        # of a 16-bit tangent would run in 16 bits. Others (relu's) take them as they are.
        if any(e.primitive.name in _SUMS for e in equations(jaxpr)):
            tangents = (tangents[0], tuple(map(upcast, tangents[1])))
        outs = eval_jaxpr(jaxpr, jvp_consts, [*args, *tangents[1]], context)
        n = len(out_zeros)
        primals_out = [y.astype(d) for y, d in zip(outs[:n], dtypes, strict=True)]
        nonzero = iter(outs[n:])
        tangents_out = [
            _zero_tangent(y) if zero else _tangent_like(next(nonzero), y)
            for y, zero in zip(primals_out, out_zeros, strict=True)
        ]
        return primals_out, tangents_out

    return list(call(tuple(values[:n_consts]), tuple(values[n_consts:])))
