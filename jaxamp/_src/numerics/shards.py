"""Evaluating a ``shard_map``'s body shard by shard: each value is its shards' values,
stacked along one leading axis per manual mesh axis."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxamp._src.jaxprs import bind, varying_axes


@dataclasses.dataclass(frozen=True)
class Shards:
    """Inside a ``shard_map``'s body: the mesh, its manual axes (in the mesh's order) and
    their sizes, each value being the shards' stacked along one leading axis per manual
    axis; and whether the body is typed by what varies across shards (``check_vma``)."""

    mesh: Any
    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    check_vma: bool


_CURRENT: contextvars.ContextVar[Shards | None] = contextvars.ContextVar(
    "jaxamp_shards", default=None
)


def current() -> Shards | None:
    """The ``shard_map`` body being evaluated shard by shard, or ``None`` outside one."""
    return _CURRENT.get()


@contextlib.contextmanager
def inside(shards: Shards) -> Iterator[None]:
    """Evaluates, within the block, a ``shard_map``'s body on ``shards``."""
    token = _CURRENT.set(shards)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def lead() -> int:
    """How many leading axes (one per manual mesh axis) the values being evaluated have."""
    shards = _CURRENT.get()
    return 0 if shards is None else len(shards.axes)


def bind_eqn(eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """``eqn`` bound on ``invals``. Inside a ``shard_map``'s body, per shard: batched over
    the leading (shard) axes, or, for an equation that names the mesh's axes (``psum``,
    ``axis_index``...), under a ``shard_map`` on the body's mesh whose specs split the
    leading axes, each input replicated over the axes its type does not vary over (as
    the body holds it)."""
    shards = _CURRENT.get()
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


def to_shards(x: Any, spec: Any, shards: Shards) -> Any:
    """A global input of a ``shard_map`` as its shards' values, stacked (see ``Shards``):
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
    leading = [names.index(a) for a in axes if a in names]
    x = jnp.transpose(x, leading + [i for i, name in enumerate(names) if name is None])
    for i, a in enumerate(axes):
        if a not in names:
            x = jnp.expand_dims(x, i)
    return jnp.broadcast_to(x, shards.sizes + x.shape[len(axes) :])


def from_shards(x: Any, spec: Any, shards: Shards) -> Any:
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


def shards_of(eqn: Any) -> Shards | None:
    """How to evaluate a ``shard_map``'s body shard by shard, or ``None`` when it is
    bound whole: inside another's body, or on an abstract mesh without a concrete one
    of its shape set (``jax.set_mesh``)."""
    p = eqn.params
    mesh = _concrete_mesh(p.get("mesh"))
    if (
        _CURRENT.get() is not None
        or mesh is None
        or not hasattr(jax, "shard_map")
        or "in_specs" not in p
        or "out_specs" not in p
    ):
        return None
    manual = p.get("newly_manual_axes") or p.get("manual_axes") or frozenset(mesh.axis_names)
    axes = tuple(a for a in mesh.axis_names if a in manual)
    sizes = tuple(int(mesh.shape[a]) for a in axes)
    return Shards(mesh, axes, sizes, bool(p.get("check_vma", True)))


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


def same_on_every_shard(x: Any) -> Any:
    """A scalar of the program (a ``cond``'s index, a loop's condition): inside a
    ``shard_map``'s body, the shards' value when they all hold the same, else ``None``."""
    a = np.asarray(x)
    if lead() == 0:
        return a
    return a.flat[0] if a.size and bool(np.all(a == a.flat[0])) else None
