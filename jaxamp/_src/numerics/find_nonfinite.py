"""``find_nonfinite``: the first operation, forward or backward, that made an inf or a NaN."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxamp._src.dtypes import is_inexact_array
from jaxamp._src.numerics import evaluator, sites, tracing
from jaxamp._src.optim.gradients import get_loss_scale
from jaxamp._src.policy import PolicyLike


@dataclasses.dataclass(frozen=True)
class ValueRange:
    """What one value held: dtype, shape, and its range over the finite elements.

    Attributes:
      dtype: e.g. ``"float16"``.
      shape: the array's shape.
      min: the smallest finite element (``nan`` when none is finite).
      max: the largest finite element.
      max_abs: the largest finite magnitude.
      nans: how many elements are NaN.
      infs: how many elements are infinite.
    """

    dtype: str
    shape: tuple[int, ...]
    min: float
    max: float
    max_abs: float
    nans: int
    infs: int

    @classmethod
    def of(cls, x: Any) -> ValueRange:
        a = np.asarray(x)
        dtype = np.dtype(a.dtype).name if not hasattr(x, "dtype") else str(x.dtype)
        if a.dtype.kind == "c":
            a = np.abs(a)
        floating = is_inexact_array(a)  # bfloat16 too, which numpy does not call "f"
        if floating:
            a = a.astype(np.float64)
        ok = np.isfinite(a) if floating else np.ones(a.shape, bool)
        good = a[ok].astype(np.float64) if a.size else np.zeros(0)
        nan = float("nan")
        return cls(
            dtype=dtype,
            shape=tuple(a.shape),
            min=float(good.min()) if good.size else nan,
            max=float(good.max()) if good.size else nan,
            max_abs=float(np.abs(good).max()) if good.size else nan,
            nans=int(np.isnan(a).sum()) if floating else 0,
            infs=int(np.isinf(a).sum()) if floating else 0,
        )

    def __str__(self) -> str:
        bad = f", {self.nans} NaN, {self.infs} inf" if self.nans or self.infs else ""
        if self.nans + self.infs == int(np.prod(self.shape, dtype=np.int64)):
            return f"{self.dtype}{list(self.shape)}, no finite element ({bad[2:]})"
        return (
            f"{self.dtype}{list(self.shape)} in [{self.min:.4g}, {self.max:.4g}] "
            f"(max |x| {self.max_abs:.4g}{bad})"
        )


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first primitive whose output is non-finite while its inputs are finite, or
    non-finite only through a constant (a mask of ``-inf``, or ``1e30`` traced in
    float16, which is inf there).

    Attributes:
      phase: ``"forward"``, ``"backward"`` (computing the gradient), or ``"input"``
        when an argument was already non-finite (``layer`` is then its path).
      layer: the module path from the name stack (``"Model/block/Dense_0"``), ``""``
        outside any named layer.
      primitive: the JAX primitive, e.g. ``"log"``, ``"dot_general"``.
      source: ``file:line (function)`` of the code that traced it (for the backward
        rule of a ``custom_vjp``, the rule).
      inputs: the range of each input.
      output: the range of the first non-finite output.
      iteration: loop iterations it ran in (outermost first), ``()`` outside loops.
      name_stack: the full name stack JAX recorded.
      forward_only: why only the forward pass was checked: ``"grad=False"`` or ``"the
        function returns a non-scalar"``; ``""`` when the gradient was checked too.
    """

    phase: str
    layer: str
    primitive: str
    source: str
    inputs: tuple[ValueRange, ...]
    output: ValueRange
    iteration: tuple[int, ...] = ()
    name_stack: str = ""
    forward_only: str = ""

    def __str__(self) -> str:
        where = self.layer or "(no layer)"
        if sites.LOSS_SCALE_SCOPE in self.name_stack:
            where = "the loss times the loss scale"
        loop = f", loop iteration {list(self.iteration)}" if self.iteration else ""
        lines = [
            f"{self.phase} {self.primitive} in {where}{loop}: output {self.output}",
            *(f"  input {i}: {r}" for i, r in enumerate(self.inputs)),
        ]
        if self.source:
            lines.append(f"  at {self.source}")
        if self.forward_only:
            lines.append(f"  forward only: {self.forward_only}, so no gradient was taken")
        return "\n".join(lines)


def find_nonfinite(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    policy: PolicyLike | Callable[..., Any] | None = None,
    has_aux: bool = False,
    loss_scale: Any = None,
    grad: bool = True,
) -> Callable[..., NonFinite | None]:
    """Finds the operation that first produced an inf or a NaN in ``fun`` or its gradient.

    ``find_nonfinite(loss_fn)(params, batch)`` traces ``jax.value_and_grad(loss_fn)``
    as the training step does (under the model's policy, ``jaxamp.autocast`` and any
    ``jit`` inside), then evaluates it one primitive at a time on the given values,
    forward pass first, then the gradient's computation. Unlike ``jax_debug_nans`` and
    ``checkify`` it catches infs (how float16 overflow shows), says whether the fault
    is in the forward or the backward pass, and names the layer. A forward fault is
    reported before any backward one, since the forward pass runs first (the forward
    sweep of a gradient also computes derivatives for the backward pass, such as
    ``0.5 / sqrt(x)``: those count as backward, in a ``lax.scan`` too). It is a
    debugging tool: slow (one dispatch per primitive), and it takes nothing from a
    normal step.

    A ``jax.shard_map`` inside ``fun`` is entered: its body runs on every shard at once
    (its collectives across them, as on the mesh), so that a fault there is named by
    its layer and line; the ranges it shows are then the shards' values, stacked along
    one leading axis per mesh axis (``float32[8, 1, 2]`` for a ``[1, 2]`` block on each
    of 8 devices). A ``shard_map`` inside another's body runs whole.

    An operation whose inputs are finite but whose output is not is a fault. So is one
    fed a non-finite constant (``x - 1e30 * (1 - mask)`` traced in float16, where
    ``1e30`` is inf; ``jnp.where(mask, x, -jnp.inf)``) when what it makes reaches the
    loss or the gradient: a ``-inf`` fill that every softmax row absorbs is not one,
    a row with nothing left to keep (0 / 0) is.

    Args:
      fun: the loss, a function returning a floating scalar (``(loss, aux)`` with
        ``has_aux``). NNX modules among its arguments are split: those at ``argnums``
        are differentiated with respect to their ``nnx.Param`` variables, and every
        submodule's operations are named after its path; the modules are not changed.
        A function returning anything else (activations) is checked forward only,
        with a warning, as with ``grad=False``.
      argnums: the arguments to differentiate with respect to.
      policy: run ``fun`` under this policy (a ``jaxamp.Policy``, a ``jmp.Policy`` or a string:
        ``fun`` runs under ``jaxamp.autocast``), or pass the mixed-precision version
        of ``fun`` itself; ``None`` (default): ``fun`` as it is.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      loss_scale: multiply the loss by this before differentiating, as a loss-scaled
        step does with ``jaxamp.scale_loss`` (a 16-bit loss is cast to float32 first):
        a number, or an optimizer state holding ``jaxamp.loss_scaled``'s (its current
        scale is used). ``None``: no scaling.
      grad: ``False`` checks the forward pass alone (``fun`` may then return anything).

    Returns:
      A function of ``fun``'s arguments returning ``None`` when every value, forward
      and backward, is finite, else a ``NonFinite``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxamp
      >>> def loss(w, x):
      ...     with jax.named_scope("head"):
      ...         return jnp.sum(jnp.sqrt(w * x))
      >>> fault = jaxamp.find_nonfinite(loss)(jnp.array([1.0, 2.0]), jnp.array([1.0, 0.0]))
      >>> fault.phase, fault.layer, fault.primitive  # d sqrt(u)/du at u = 0
      ('backward', 'head', 'div')
      >>> jaxamp.find_nonfinite(loss)(jnp.array([1.0, 2.0]), jnp.array([1.0, 1.0])) is None
      True
    """
    scale = scale_of(loss_scale)
    target, _ = tracing.under_policy(fun, policy)

    def find(*args: Any, **kwargs: Any) -> NonFinite | None:
        bad_input = _first_nonfinite_argument(args, kwargs)
        if bad_input is not None:
            return bad_input
        traced, forward_only = tracing.trace_or_forward(
            "find_nonfinite",
            target,
            argnums,
            args,
            kwargs,
            has_aux=has_aux,
            loss_scale=scale,
            grad=grad,
        )
        origins = _Origins(forward_only)
        result = evaluator.run(
            traced.jaxpr,
            traced.args,
            lambda *_: None,
            traced.primal_outputs,
            tagger=origins,
            rules=traced.rules,
        )
        if result is None:  # stopped at a forward fault
            return origins.faults[-1]
        p = traced.primal_outputs
        outputs = result[1] if p is None else [result[1][0], *result[1][p:]]
        return origins.first(outputs)

    return find


CONSTANT = "constant"  # the tag of a value computed from the program's constants alone


def constant(tags: Sequence[Any], inputs: Sequence[Any], bad: Sequence[bool]) -> bool:
    """Whether an operation's outputs are constants: its inputs are, and it does not
    make an inf or a NaN of finite ones (a loss scale of 65536 cast to float16 does)."""
    if not all(t is CONSTANT for t in tags):
        return False
    return not any(bad) or not all(evaluator.finite(i) for i in inputs)


def carried(tags: Sequence[Any]) -> frozenset:
    """The origins the non-finite inputs of an operation carry (``frozenset()``: none)."""
    return frozenset().union(*(t for t in tags if isinstance(t, frozenset)))


def merge_tags(tags: Sequence[Any]) -> Any:
    """A stacked scan output's tag, from its iterations' tags."""
    if tags and all(t is CONSTANT for t in tags):
        return CONSTANT
    return carried(tags) or None


class _Origins:
    """A ``sites.Tagger`` that follows every inf and NaN to the operations that
    made it. A value's tag is ``CONSTANT`` (from constants alone), ``None`` (finite,
    or not followed), or the set of the faults (indices in ``faults``) its non-finite
    elements come from."""

    constant = CONSTANT

    def __init__(self, forward_only: str):
        self.forward_only = forward_only
        self.faults: list[NonFinite] = []
        self.strict: list[bool] = []  # made from finite inputs (else: fed a constant)

    def op(
        self,
        site: sites.Site,
        tags: Sequence[Any],
        inputs: Sequence[Any],
        outputs: Sequence[Any],
    ) -> tuple[list[Any], bool]:
        bad = [not evaluator.finite(o) for o in outputs]
        if constant(tags, inputs, bad):
            return [CONSTANT] * len(outputs), False
        if not any(bad):
            return [None] * len(outputs), False
        came_from = carried(tags)
        if came_from:  # an earlier fault's inf or NaN, carried on
            return [came_from if b else None for b in bad], False
        index, strict = len(self.faults), all(evaluator.finite(i) for i in inputs)
        self.faults.append(self._fault(site, inputs, outputs[bad.index(True)]))
        self.strict.append(strict)
        # The forward pass runs first: its first fault made from finite inputs is the
        # answer, unless one fed a constant came before it (whether that one reaches the
        # loss or the gradient is known only at the end).
        first_forward = all(f.phase != "forward" for f in self.faults[:index])
        stop = site.phase == "forward" and strict and first_forward
        return [frozenset({index}) if b else None for b in bad], stop

    def merge(self, tags: Sequence[Any]) -> Any:
        return merge_tags(tags)

    def _fault(self, site: sites.Site, inputs: Sequence[Any], output: Any) -> NonFinite:
        return NonFinite(
            phase=site.phase,
            layer=site.layer,
            primitive=site.primitive,
            source=site.source,
            inputs=tuple(ValueRange.of(i) for i in inputs if hasattr(i, "shape")),
            output=ValueRange.of(output),
            iteration=site.iteration,
            name_stack=site.name_stack,
            forward_only=self.forward_only,
        )

    def first(self, outputs: Sequence[Any]) -> NonFinite | None:
        """The fault to report, given the tags of the loss and the gradient: the first
        forward one, else the first backward one, that is made from finite inputs or
        reaches them."""
        reached = carried(outputs)
        for phase in ("forward", "backward"):
            for i, fault in enumerate(self.faults):
                if fault.phase == phase and (self.strict[i] or i in reached):
                    return fault
        return None


def scale_of(loss_scale: Any) -> float | None:
    if loss_scale is None:
        return None
    if isinstance(loss_scale, (int, float, np.number)) or (
        hasattr(loss_scale, "shape") and np.shape(loss_scale) == ()
    ):
        value, source = float(loss_scale), ""
    else:
        value = float(get_loss_scale(loss_scale))
        source = " (the scale of the jaxamp.loss_scaled optimizer state given)"
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"loss_scale must be a positive, finite number, got {value!r}{source}.")
    return value


def _first_nonfinite_argument(args: Sequence[Any], kwargs: dict[str, Any]) -> NonFinite | None:
    leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    leaves += jax.tree_util.tree_flatten_with_path(kwargs)[0]
    for path, leaf in leaves:
        if hasattr(leaf, "dtype") and not evaluator.finite(leaf):
            where = jax.tree_util.keystr(path)
            return NonFinite("input", where, "", "", (), ValueRange.of(leaf), name_stack=where)
    return None
