"""Evaluating a loss and its gradient one primitive at a time, on concrete values, for the
numerics tools (a debugging path: nothing here runs in a training step)."""

from __future__ import annotations

import contextvars
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxamp._src.audit.checks import short_name
from jaxamp._src.dtypes import is_16bit, is_inexact
from jaxamp._src.jaxprs import bind, is_backward_name, open_jaxpr, varying_axes
from jaxamp._src.numerics import phases, sources

LOSS_SCALE_SCOPE = "jaxamp_loss_scale"  # the multiplication of the loss by the loss scale


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a primitive runs.

    Attributes:
      primitive: the JAX primitive (``"log"``, ``"dot_general"``...).
      phase: ``"forward"`` or ``"backward"`` (the gradient's computation).
      layer: the module path, e.g. ``"Model/Dense_0"``; ``""`` outside any layer.
      source: ``file:line (function)`` of the user code that traced it.
      name_stack: the name stack JAX recorded, in full.
      iteration: the loop iterations it runs in (outermost first), ``()`` outside loops.
      sixteen_bit: per output, whether the program holds it in a 16-bit type (when
        evaluated widened, the value seen is its float32 counterpart).
      eqn: the equation itself (for ``in_float32``).

    Inside a ``shard_map``'s body, the inputs and outputs a visitor is handed are the
    shards' values, stacked along one leading axis per manual mesh axis (in the mesh's
    order).
    """

    primitive: str
    phase: str
    layer: str
    source: str
    name_stack: str
    iteration: tuple[int, ...] = ()
    sixteen_bit: tuple[bool, ...] = ()
    eqn: Any = dataclasses.field(default=None, repr=False, compare=False)


Visitor = Callable[[Site, Sequence[Any], Sequence[Any]], bool | None]


class _Stop(Exception):
    pass


class Tagger(Protocol):
    """Follows values through an evaluation: each value carries a tag, which the tagger
    computes for every primitive's outputs from its inputs' tags.

    Attributes:
      constant: the tag of a literal or a constant of the program (the arguments'
        tag is ``None``).
    """

    constant: Any

    def op(
        self, site: Site, tags: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any]
    ) -> tuple[list[Any], bool]:
        """The outputs' tags, and whether to stop the evaluation."""
        ...

    def merge(self, tags: Sequence[Any]) -> Any:
        """The tag of a scan's stacked output, from its iterations' (``[]``: none ran)."""
        ...


@dataclasses.dataclass
class _Context:
    visit: Visitor
    primal: set[int] | None = None
    tagger: Tagger | None = None
    rules: Callable[[], dict[Any, str]] | None = None  # custom_vjp backward rules


def _join(prefix: str, eqn: Any) -> str:
    stack = str(getattr(getattr(eqn, "source_info", None), "name_stack", "") or "")
    return "/".join(p for p in (prefix, stack) if p)


def _layer(stack: str, primitive: str) -> str:
    """The layer path of a name stack. A module that evaluates its call again inside its
    own scope (``jaxamp.nnx``'s policy interprets the call it traced) repeats its name;
    the repeats are one layer. ``jnp.einsum``'s scope (its spec) belongs to the layer
    that calls it."""
    # jnp.einsum names a scope after its spec ("...qhd,...khd->...hqk"): not a layer
    parts = short_name(f"f/{stack}/{primitive}").split("/")
    parts = [p for p in parts if "->" not in p and p != LOSS_SCALE_SCOPE]
    return "/".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])


_WIDEN: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxamp_widen", default=False)


@dataclasses.dataclass(frozen=True)
class _Shards:
    """Inside a ``shard_map``'s body: the mesh, its manual axes (in the mesh's order) and
    their sizes, each value being the shards' stacked along one leading axis per manual
    axis; and whether the body is typed by what varies across shards (``check_vma``)."""

    mesh: Any
    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    check_vma: bool


_SHARDS: contextvars.ContextVar[_Shards | None] = contextvars.ContextVar(
    "jaxamp_shards", default=None
)


def _lead() -> int:
    """How many leading axes (one per manual mesh axis) the values being evaluated have."""
    shards = _SHARDS.get()
    return 0 if shards is None else len(shards.axes)


def _apply(eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """``eqn`` bound on ``invals``. Inside a ``shard_map``'s body, per shard: batched over
    the leading (shard) axes, or, for an equation that names the mesh's axes (``psum``,
    ``axis_index``...), under a ``shard_map`` on the body's mesh whose specs split the
    leading axes, each input replicated over the axes its type does not vary over (as
    the body holds it)."""
    shards = _SHARDS.get()
    if shards is None:
        return bind(eqn, invals, params)
    k = len(shards.axes)
    if not _names_axes(eqn.params, shards.axes):
        # computed on each shard alone: batched over the shards (a shard_map compiles)
        fun = lambda *xs: bind(eqn, xs, params)
        for size in reversed(shards.sizes):  # the last mesh axis innermost
            fun = jax.vmap(fun, axis_size=size)
        return list(fun(*(jnp.asarray(x) for x in invals)))

    def spec(atom: Any) -> PartitionSpec:
        vma = varying_axes(atom.aval) if shards.check_vma else None
        return PartitionSpec(*(a if vma is None or a in vma else None for a in shards.axes))

    in_specs = tuple(spec(a) for a in eqn.invars)
    out_specs = tuple(spec(v) for v in eqn.outvars)
    args = [
        jnp.asarray(x)[tuple(slice(None) if a is not None else slice(0, 1) for a in s)]
        for x, s in zip(invals, in_specs, strict=True)
    ]

    def per_shard(*xs: Any) -> tuple[Any, ...]:
        outs = bind(eqn, [x.reshape(x.shape[k:]) for x in xs], params)
        return tuple(o.reshape((1,) * k + o.shape) for o in outs)

    outs = jax.shard_map(
        per_shard,
        mesh=shards.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(shards.axes),
        check_vma=shards.check_vma,
    )(*args)
    return [jnp.broadcast_to(o, shards.sizes + o.shape[k:]) for o in outs]


_SHARDING_TYPES = tuple(
    t
    for t in (
        getattr(jax.sharding, n, None)
        for n in ("Sharding", "PartitionSpec", "Mesh", "AbstractMesh")
    )
    if isinstance(t, type)
)


def _names_axes(value: Any, axes: Sequence[str]) -> bool:
    """Whether an equation's parameters name one of the mesh ``axes`` (a collective's,
    ``axis_index``'s), hold a sharding (of the body's manual mesh), or a jaxpr (a
    ``cond`` or a loop run whole, which may name them)."""
    if isinstance(value, _SHARDING_TYPES):
        return True
    if isinstance(value, str):
        return value in axes
    if isinstance(value, dict):
        return any(_names_axes(v, axes) for v in value.values())
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(_names_axes(v, axes) for v in value)
    return isinstance(value, (jex.core.ClosedJaxpr, jex.core.Jaxpr))


def _group(entry: Any, axes: Sequence[str]) -> tuple[str, ...]:
    """The manual mesh axes a ``PartitionSpec`` entry splits a dimension over."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in names if a in axes)


def _to_shards(x: Any, spec: Any, shards: _Shards) -> Any:
    """A global input of a ``shard_map`` as its shards' values, stacked (see ``_Shards``):
    split along the dimensions ``spec`` names mesh axes for, repeated along the others."""
    x = jnp.asarray(x)
    axes, sizes = shards.axes, dict(zip(shards.axes, shards.sizes, strict=True))
    shape: list[int] = []
    names: list[str | None] = []
    for d, n in enumerate(x.shape):
        group = _group(spec[d] if d < len(spec) else None, axes)
        shape += [sizes[a] for a in group] + [n // math.prod(sizes[a] for a in group)]
        names += [*group, None]
    x = x.reshape(shape)
    lead = [names.index(a) for a in axes if a in names]
    x = jnp.transpose(x, lead + [i for i, name in enumerate(names) if name is None])
    for i, a in enumerate(axes):
        if a not in names:
            x = jnp.expand_dims(x, i)
    return jnp.broadcast_to(x, shards.sizes + x.shape[len(axes) :])


def _from_shards(x: Any, spec: Any, shards: _Shards) -> Any:
    """A ``shard_map``'s global output from its shards' values, stacked: joined along
    the dimensions ``spec`` names mesh axes for, the first shard's along the others (the
    shards agree there)."""
    x = jnp.asarray(x)
    axes, sizes = shards.axes, dict(zip(shards.axes, shards.sizes, strict=True))
    local = x.shape[len(axes) :]
    groups = [_group(spec[d] if d < len(spec) else None, axes) for d in range(len(local))]
    used = {a for g in groups for a in g}
    x = x[tuple(slice(None) if a in used else 0 for a in axes)]
    kept = [a for a in axes if a in used]
    order: list[int] = []
    for d, group in enumerate(groups):
        order += [kept.index(a) for a in group] + [len(kept) + d]
    shape = [n * math.prod(sizes[a] for a in g) for n, g in zip(local, groups, strict=True)]
    return jnp.transpose(x, order).reshape(shape)


def _enter_shards(eqn: Any) -> _Shards | None:
    """How to evaluate a ``shard_map``'s body shard by shard, or ``None`` when it is
    bound whole: inside another's body, or on an abstract mesh without a concrete one
    of its shape set (``jax.set_mesh``)."""
    p = eqn.params
    mesh = _concrete_mesh(p.get("mesh"))
    if (
        _SHARDS.get() is not None
        or mesh is None
        or not hasattr(jax, "shard_map")
        or "in_specs" not in p
        or "out_specs" not in p
    ):
        return None
    manual = p.get("newly_manual_axes") or p.get("manual_axes") or frozenset(mesh.axis_names)
    axes = tuple(a for a in mesh.axis_names if a in manual)
    sizes = tuple(int(mesh.shape[a]) for a in axes)
    return _Shards(mesh, axes, sizes, bool(p.get("check_vma", True)))


def _concrete_mesh(mesh: Any) -> Any:
    """``mesh``, or for an abstract one the concrete mesh set of its shape, else ``None``."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    try:
        current = get_mesh() if get_mesh is not None and mesh is not None else None
        same = (
            isinstance(current, jax.sharding.Mesh)
            and tuple(current.axis_names) == tuple(mesh.axis_names)
            and dict(current.shape) == dict(mesh.shape)
        )
    except (AttributeError, TypeError, ValueError):
        return None
    return current if same else None


def _is_sixteen(dtype: Any) -> bool:
    try:
        return is_16bit(dtype)
    except TypeError:  # an extended dtype (a PRNG key)
        return False


def _widened(value: Any) -> Any:
    if _is_sixteen(getattr(value, "dtype", None)):
        return value.astype(jnp.float32) if hasattr(value, "astype") else np.float32(value)
    return value


def _bind_widened(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``eqn`` computed in float32 where the program computes in 16 bits: its 16-bit
    inputs and the 16-bit dtypes among its parameters (a convert's target, a dot's
    preferred result) widened, so that a value past float16's range shows its size
    rather than an inf. ``reduce_precision`` passes its input through. A primitive that
    refuses the widened operands runs as traced."""
    if eqn.primitive.name == "reduce_precision":
        return [_widened(invals[0])]
    params = {k: (np.dtype(jnp.float32) if _is_sixteen(v) else v) for k, v in eqn.params.items()}
    try:
        return _apply(eqn, [_widened(v) for v in invals], params)
    except (TypeError, ValueError):
        traced = [
            v.astype(a.aval.dtype) if hasattr(v, "astype") and hasattr(a, "aval") else v
            for v, a in zip(invals, eqn.invars, strict=True)
        ]
        return _apply(eqn, traced)


def _site(eqn: Any, stack: str, iteration: tuple[int, ...], ctx: _Context, where: str) -> Site:
    backward = is_backward_name(stack) or (ctx.primal is not None and id(eqn) not in ctx.primal)
    return Site(
        primitive=eqn.primitive.name,
        phase="backward" if backward else "forward",
        layer=_layer(stack, eqn.primitive.name),
        source=sources.source(eqn, ctx.rules if backward else None, where),
        name_stack=stack,
        iteration=iteration,
        sixteen_bit=tuple(_is_sixteen(getattr(v.aval, "dtype", None)) for v in eqn.outvars),
        eqn=eqn,
    )


def in_float32(site: Site, inputs: Sequence[Any]) -> list[Any]:
    """The outputs of the primitive at ``site`` on ``inputs``, computed in float32 where
    the program computes in 16 bits (see ``_bind_widened``)."""
    return _bind_widened(site.eqn, inputs)


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    ctx: _Context,
    prefix: str = "",
    iteration: tuple[int, ...] = (),
    tags: Sequence[Any] | None = None,
    where: str = "",
) -> tuple[list[Any], list[Any]]:
    """Evaluates ``jaxpr`` on concrete ``args`` (tagged ``tags``), calling
    ``ctx.visit(site, inputs, outputs)`` after each primitive; a visitor that returns
    ``True`` stops the evaluation (``run`` then returns early). Returns the outputs
    and their tags (all ``None`` without a tagger). ``where``: the source of the call
    ``jaxpr`` is the body of, for equations whose own traceback shows no model code."""
    values: dict[Any, Any] = {}
    tagged: dict[Any, Any] = {}
    constant = ctx.tagger.constant if ctx.tagger is not None else None

    shards = _SHARDS.get()

    def read(atom: Any) -> Any:
        if not isinstance(atom, jex.core.Literal):
            return values[atom]
        if shards is None:
            return atom.val
        value = jnp.asarray(atom.val, getattr(atom.aval, "dtype", None))
        return jnp.broadcast_to(value, shards.sizes + value.shape)  # the same on every shard

    if shards is not None:  # a constant is the same on every shard
        consts = [jnp.broadcast_to(c, shards.sizes + jnp.shape(c)) for c in consts]

    def tag(atom: Any) -> Any:
        return constant if isinstance(atom, jex.core.Literal) else tagged.get(atom)

    values.update(zip(jaxpr.constvars, consts, strict=True))
    values.update(zip(jaxpr.invars, args, strict=True))
    tagged.update((v, constant) for v in jaxpr.constvars)
    tagged.update(zip(jaxpr.invars, tags or [None] * len(args), strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        outs, out_tags = _evaluate_eqn(
            eqn, invals, [tag(a) for a in eqn.invars], ctx, _join(prefix, eqn), iteration, where
        )
        values.update(zip(eqn.outvars, outs, strict=True))
        tagged.update(zip(eqn.outvars, out_tags, strict=True))
    return [read(v) for v in jaxpr.outvars], [tag(v) for v in jaxpr.outvars]


def _inner(
    closed: Any,
    invals: Sequence[Any],
    tags: Sequence[Any] | None,
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    jaxpr, consts = open_jaxpr(closed)
    return evaluate(jaxpr, consts, invals, ctx, stack, iteration, tags, where)


def _evaluate_eqn(
    eqn: Any,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    name = eqn.primitive.name
    inners = phases.inner_jaxprs(eqn)
    if inners or name in ("scan", "while"):
        where = sources.own_source(eqn) or where
    if name == "cond":
        index, *operands = invals
        chosen = _same_on_every_shard(index)
        if chosen is not None:
            branch = inners[int(np.clip(int(chosen), 0, len(inners) - 1))]
            return _inner(branch, operands, tags[1:], ctx, stack, iteration, where)
        # shards that take different branches: the cond runs whole
    elif name == "shard_map":
        shards = _enter_shards(eqn)
        if shards is not None:
            return _shard_map(eqn, shards, invals, tags, ctx, stack, iteration, where)
    elif inners:
        return _inner(inners[0], invals, tags, ctx, stack, iteration, where)
    if name == "scan":
        return _scan(eqn, invals, tags, ctx, stack, iteration, where)
    if name == "while":
        return _while(eqn, invals, tags, ctx, stack, iteration, where)
    return _primitive(eqn, invals, tags, ctx, stack, iteration, where)


def _same_on_every_shard(x: Any) -> Any:
    """A scalar of the program (a ``cond``'s index, a loop's condition): inside a
    ``shard_map``'s body, the shards' value when they all hold the same, else ``None``."""
    a = np.asarray(x)
    if _lead() == 0:
        return a
    return a.flat[0] if a.size and bool(np.all(a == a.flat[0])) else None


def _shard_map(
    eqn: Any,
    shards: _Shards,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    """A ``shard_map``'s body evaluated on its shards (see ``_Shards``)."""
    p = eqn.params
    args = [_to_shards(x, s, shards) for x, s in zip(invals, p["in_specs"], strict=True)]
    token = _SHARDS.set(shards)
    try:
        outs, out_tags = _inner(p["jaxpr"], args, tags, ctx, stack, iteration, where)
    finally:
        _SHARDS.reset(token)
    outs = [_from_shards(o, s, shards) for o, s in zip(outs, p["out_specs"], strict=True)]
    return outs, out_tags


def _primitive(
    eqn: Any,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    """One primitive (or an equation run whole), visited and tagged."""
    outs = _bind_widened(eqn, invals) if _WIDEN.get() else _apply(eqn, invals)
    site = _site(eqn, stack, iteration, ctx, where)
    if ctx.visit(site, invals, outs):
        raise _Stop
    if ctx.tagger is None:
        return outs, [None] * len(outs)
    out_tags, stop = ctx.tagger.op(site, tags, invals, outs)
    if stop:
        raise _Stop
    return outs, out_tags


def _scan(
    eqn: Any,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry = invals[:n_consts], list(invals[n_consts : n_consts + n_carry])
    const_tags, carry_tags = tags[:n_consts], list(tags[n_consts : n_consts + n_carry])
    xs, xs_tags = invals[n_consts + n_carry :], tags[n_consts + n_carry :]
    ys: list[list[Any]] = []
    ys_tags: list[list[Any]] = []
    order = range(length - 1, -1, -1) if p.get("reverse", False) else range(length)
    lead = _lead()  # the shards' axes come first inside a shard_map
    for i in order:
        operands = [*consts, *carry, *(x[(slice(None),) * lead + (i,)] for x in xs)]
        outs, out_tags = _inner(
            p["jaxpr"],
            operands,
            [*const_tags, *carry_tags, *xs_tags],
            ctx,
            stack,
            (*iteration, i),
            where,
        )
        carry, y = outs[:n_carry], outs[n_carry:]
        carry_tags = out_tags[:n_carry]
        ys.append(y)
        ys_tags.append(out_tags[n_carry:])
    if p.get("reverse", False):
        ys.reverse()
    n_ys = len(eqn.outvars) - n_carry
    stacked = [
        jnp.stack([y[j] for y in ys], axis=lead) if ys else _empty(eqn.outvars[n_carry + j].aval)
        for j in range(n_ys)
    ]
    merged = [
        ctx.tagger.merge([t[j] for t in ys_tags]) if ctx.tagger is not None else None
        for j in range(n_ys)
    ]
    return [*carry, *stacked], [*carry_tags, *merged]


def _empty(aval: Any) -> Any:
    """The stacked output of a scan of no iterations: ``aval``'s shape and dtype (per
    shard inside a ``shard_map``)."""
    shards = _SHARDS.get()
    return jnp.zeros((shards.sizes if shards is not None else ()) + aval.shape, aval.dtype)


def _while(
    eqn: Any,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
    body_tags = tags[n_cond : n_cond + n_body]
    carry, carry_tags = list(invals[n_cond + n_body :]), list(tags[n_cond + n_body :])
    quiet = _Context(lambda *_: None)  # the loop's condition is not part of the model
    i = 0
    while True:
        pred = _inner(p["cond_jaxpr"], [*cond_consts, *carry], None, quiet, stack, iteration, where)
        go = _same_on_every_shard(pred[0][0])
        if go is None:  # shards that stop at different iterations: the rest runs whole
            rest = [*cond_consts, *body_consts, *carry]
            rest_tags = [*tags[:n_cond], *body_tags, *carry_tags]
            return _primitive(eqn, rest, rest_tags, ctx, stack, (*iteration, i), where)
        if not bool(go):
            break
        carry, carry_tags = _inner(
            p["body_jaxpr"],
            [*body_consts, *carry],
            [*body_tags, *carry_tags],
            ctx,
            stack,
            (*iteration, i),
            where,
        )
        i += 1
    return carry, carry_tags


def run(
    jaxpr: Any,
    args: Sequence[Any],
    visit: Visitor,
    primal_outputs: int | None = None,
    widen: bool = False,
    tagger: Tagger | None = None,
    rules: Callable[[], dict[Any, str]] | None = None,
) -> tuple[list[Any], list[Any]] | None:
    """Evaluates a ``ClosedJaxpr`` on ``args``: its outputs and their tags (``None``
    without a ``tagger``), or ``None`` when the visitor or the tagger stopped it.

    ``widen``: compute what the program computes in 16 bits in float32 instead (see
    ``_bind_widened``), so that a visitor sees how large those values get.

    ``primal_outputs``: how many of the outputs are the function's value (the rest being
    its gradient); equations the value does not depend on are reported as backward.
    ``None``: every equation outside a transpose is forward.

    ``rules``: where each ``custom_vjp``'s backward rule is, per call site
    (``sources.custom_vjp_rules`` of the forward program), to name the rule as the
    source of its equations; called only when one is met."""
    inner, consts = open_jaxpr(jaxpr)
    primal = None
    if primal_outputs is not None:
        needed = [i < primal_outputs for i in range(len(inner.outvars))]
        primal = phases.primal_equations(inner, needed)[0]
    token = _WIDEN.set(widen)
    try:
        return evaluate(inner, consts, args, _Context(visit, primal, tagger, rules))
    except _Stop:
        return None
    finally:
        _WIDEN.reset(token)


def is_floating(x: Any) -> bool:
    """Whether ``x`` has a floating or complex dtype (bfloat16 too, unlike numpy's "f")."""
    return is_inexact(getattr(x, "dtype", None))


def finite(x: Any) -> bool:
    """Whether every element of a floating value is finite (non-floating values are)."""
    return not is_floating(x) or bool(np.all(np.isfinite(np.asarray(x))))
