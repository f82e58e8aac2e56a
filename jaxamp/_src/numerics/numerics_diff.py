"""``numerics_diff``: per layer, how far a mixed-precision step departs from float32."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np

from jaxamp._src.dtypes import is_inexact_array
from jaxamp._src.numerics import evaluator, sites, tracing
from jaxamp._src.numerics.find_nonfinite import scale_of
from jaxamp._src.policy import PolicyLike

# A layer whose float32 value has an RMS below this fraction of the typical RMS of its
# pass (the median over the model's layers) is "near zero" (see LayerDiff.scale_error).
NEAR_ZERO = 1e-3


@dataclasses.dataclass(frozen=True)
class LayerDiff:
    """One layer's value under the policy against float32.

    Attributes:
      layer: the module path (``""``: outside any named layer).
      phase: ``"forward"`` (the layer's output: the last value its forward pass
        computes) or ``"backward"`` (the gradients of the layer's own parameters,
        taken together: for a Dense layer its kernel's and bias's).
      relative_error: ``||amp - fp32|| / ||fp32||`` (Frobenius norms, in float64); ``inf``
        when the policy's value is not finite; ``None`` when the two runs' values have
        different shapes (not comparable). Meaningless for a float32 value that is (near)
        zero, such as the output of a zero-initialised scale: see ``scale_error``.
      shape: the value's shape (for ``"backward"``: ``(number of gradient elements,)``).
      scale_error: ``||amp - fp32|| / max(||fp32||, NEAR_ZERO * typical * sqrt(size))``,
        where ``typical`` is the median, over the layers of this phase, of the float32
        value's RMS (``||fp32|| / sqrt(size)``; zeros left out): the relative error,
        except that a near-zero value is measured against the typical size of the
        model's values instead of its own. ``0.0`` exactly when the two values are
        identical; ``inf`` when the policy's is not finite; ``None`` when not comparable.
      cosine: the cosine similarity of the two values, ``None`` when either is zero,
        not finite or not comparable.
      near_zero: the float32 value's RMS is at most ``NEAR_ZERO`` times the typical
        (exact zeros included): its relative error says nothing.
      size_ratio: ``||amp|| / ||fp32||``: below 1 by much, the policy's value lost size
        (elements flushed to zero); ``None`` when fp32's is zero, either is not finite,
        or they are not comparable.
    """

    layer: str
    phase: str
    relative_error: float | None
    shape: tuple[int, ...]
    scale_error: float | None = None
    cosine: float | None = None
    near_zero: bool = False
    size_ratio: float | None = None


@dataclasses.dataclass(frozen=True)
class NumericsDiff:
    """Where a policy departs from float32, layer by layer.

    Attributes:
      layers: one ``LayerDiff`` per (layer, phase), in the float32 run's order.
      gradients: ``(path, relative error)`` of each gradient leaf (``fun``'s gradient
        with respect to ``argnums``), e.g. ``("[0]['params']['Dense_0']['kernel']", 0.004)``;
        the error is ``None`` where the two runs' gradients differ in shape.
      loss: ``(float32 loss, policy loss)``, or ``None`` where ``fun``'s value is not a
        scalar.
    """

    layers: tuple[LayerDiff, ...]
    gradients: tuple[tuple[str, float | None], ...]
    loss: tuple[float, float] | None

    def worst(self, n: int = 5, phase: str | None = None) -> list[LayerDiff]:
        """The ``n`` layers that depart most (of ``phase`` when given)."""
        rows = [r for r in self.layers if r.relative_error is not None]
        rows = [r for r in rows if phase is None or r.phase == phase]
        return sorted(rows, key=lambda r: -cast(float, r.relative_error))[:n]

    def table(self) -> str:
        """A text table: per layer, the relative error of its output and its gradient."""
        by_layer: dict[str, dict[str, LayerDiff]] = {}
        for r in self.layers:
            by_layer.setdefault(r.layer, {})[r.phase] = r
        rows: list[tuple[str, ...]] = [("layer", "activation rel. error", "gradient rel. error")]
        for layer, phases in by_layer.items():
            cells = [
                "-" if r is None or r.relative_error is None else f"{r.relative_error:.2e}"
                for r in (phases.get("forward"), phases.get("backward"))
            ]
            rows.append((layer or "(no layer)", *cells))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        return "\n".join(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        )


def _relative(amp: Any, ref: Any) -> float | None:
    a, r = np.asarray(amp).astype(np.float64), np.asarray(ref).astype(np.float64)
    if a.shape != r.shape:
        return None
    if not np.all(np.isfinite(a)):
        return float("inf")
    scale = float(np.linalg.norm(r))
    diff = float(np.linalg.norm(a - r))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


@dataclasses.dataclass(frozen=True)
class _Pair:
    """The norms of one layer's value in both runs, for its ``LayerDiff``."""

    layer: str
    phase: str
    shape: tuple[int, ...]
    ref_norm: float
    diff_norm: float | None  # None: not comparable; inf: the policy's value not finite
    cosine: float | None
    size: int
    amp_norm: float | None = None


def _pair(layer: str, phase: str, amp: Any | None, ref: Any) -> _Pair:
    """``amp`` is ``None`` when the policy's run has no such value."""
    r = np.asarray(ref).astype(np.float64)
    ref_norm, shape = float(np.linalg.norm(r)), tuple(np.shape(ref))
    a = None if amp is None else np.asarray(amp).astype(np.float64)
    if a is None or a.shape != r.shape:
        return _Pair(layer, phase, shape, ref_norm, None, None, r.size)
    if not np.all(np.isfinite(a)):
        return _Pair(layer, phase, shape, ref_norm, float("inf"), None, r.size)
    amp_norm = float(np.linalg.norm(a))
    cosine = None
    if ref_norm > 0 and amp_norm > 0:
        cosine = float(np.clip(np.vdot(a, r) / (amp_norm * ref_norm), -1.0, 1.0))
    diff_norm = float(np.linalg.norm(a - r))
    return _Pair(layer, phase, shape, ref_norm, diff_norm, cosine, r.size, amp_norm)


def _layer_diffs(pairs: list[_Pair]) -> list[LayerDiff]:
    """Each pair's ``LayerDiff``, its near-zero floor from the typical RMS of the
    float32 values of its phase."""
    typical = {}
    for phase in {p.phase for p in pairs}:
        rms = [p.ref_norm / np.sqrt(p.size) for p in pairs if p.phase == phase and p.size]
        rms = [x for x in rms if x > 0]
        typical[phase] = float(np.median(rms)) if rms else 0.0
    rows = []
    for p in pairs:
        floor = NEAR_ZERO * typical[p.phase] * np.sqrt(p.size)
        near_zero = p.ref_norm <= floor
        relative = scaled = None
        if p.diff_norm == 0:  # identical (0/0 too)
            relative = scaled = 0.0
        elif p.diff_norm is not None:
            relative = _ratio(p.diff_norm, p.ref_norm)
            scaled = _ratio(p.diff_norm, max(p.ref_norm, floor))
        rows.append(
            LayerDiff(
                p.layer,
                p.phase,
                relative,
                p.shape,
                scaled,
                p.cosine,
                bool(near_zero),
                None if p.amp_norm is None or p.ref_norm == 0 else p.amp_norm / p.ref_norm,
            )
        )
    return rows


def _ratio(diff: float, scale: float) -> float:
    return diff / scale if scale > 0 else float("inf")


def _last_values(traced: tracing.Traced) -> tuple[dict[str, Any], list[Any]]:
    """Each layer's last forward value (its output), in the order the program makes
    them, and the program's outputs. The backward pass is compared through the gradients
    of the parameters instead: the order of its operations inside a layer may differ
    between the two programs.

    Evaluated inside one ``jax.jit`` where the program allows (``evaluator.stageable``),
    so that XLA compiles it once rather than each primitive on its own; eagerly, one
    primitive at a time, where its control flow reads values."""

    order: list[str] = []  # the layers' order, kept apart: jit returns a dict's keys sorted

    def collect(args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        last: dict[str, Any] = {}

        def visit(site: sites.Site, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
            if site.primitive == "convert_element_type" or site.phase != "forward":
                return  # a cast of a value is not a new value of the layer
            if sites.LOSS_SCALE_SCOPE in site.name_stack:
                return  # the loss times the scale: not a value of the model
            floating = [o for o in outputs if is_inexact_array(o)]
            if floating:  # in the order the layers' outputs are made
                last.pop(site.layer, None)
                last[site.layer] = floating[-1]

        result = evaluator.run(traced.jaxpr, args, visit, traced.primal_outputs)
        assert result is not None  # visit never stops the run
        order[:] = last
        return list(last.values()), result[0]

    if evaluator.stageable(traced.jaxpr):
        values, outputs = jax.jit(collect)(list(traced.args))
    else:
        values, outputs = collect(traced.args)
    return dict(zip(order, values, strict=True)), outputs


_VARIABLE_VALUE = ("value", "raw_value")  # the array of an nnx.Variable, below its path


def _owner(path: Sequence[Any], single_argnum: bool) -> str:
    """The layer a gradient leaf belongs to, from its path in the gradients (a tuple,
    one entry per differentiated argument): ``(0, 'params', 'fc', 'kernel')`` -> ``'fc'``
    (the argument's index, a Flax collection name and the leaf's own name dropped); a
    leaf of a flat dict is its own layer; a bare array argument is ``arg<index>``. An
    NNX variable's array (``[0]['fc']['kernel'].value``) is its variable's leaf."""
    path = list(path)
    while (
        path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name in _VARIABLE_VALUE
    ):
        path.pop()
    keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    index, keys = keys[0], keys[1:]
    if keys and keys[0] == "params":
        keys = keys[1:]
    owner = "/".join(keys[:-1]) if len(keys) > 1 else (keys[0] if keys else f"arg{index}")
    return owner if single_argnum else f"arg{index}/{owner}"


def common_root(forward: dict[str, Any]) -> str:
    """The top module's name when every named forward layer sits under it (Flax names
    the model class in the name stack, not in the params' paths)."""
    tops = {name.split("/")[0] for name in forward if name}
    if len(tops) == 1 and any("/" in name for name in forward):
        return tops.pop()
    return ""


def numerics_diff(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    policy: PolicyLike | Callable[..., Any] | None = None,
    has_aux: bool = False,
    loss_scale: Any = None,
    grad: bool = True,
) -> Callable[..., NumericsDiff]:
    """Per layer, the relative error of activations and gradients under ``policy``
    against float32, so that you can see where mixed precision departs from FP32.

    ``jaxamp.numerics_diff(loss_fn, policy="mixed_bfloat16")(params, batch)`` evaluates the loss
    and its gradient twice, ``loss_fn`` as it is (float32) and under
    ``jaxamp.autocast(loss_fn, policy)``, keeping each layer's value: inside one ``jit``
    where the program has no ``cond``, ``while`` or ``shard_map``, else one primitive at
    a time. For a model whose policy is applied
    another way (``jaxamp.linen.apply_policy``), pass the mixed-precision loss itself as
    ``policy``. Layers are matched by the name stack, so both runs must use the same
    module names. Slow; for debugging.

    Args:
      fun: the float32 loss (a floating scalar; ``(loss, aux)`` with ``has_aux``).
      argnums: what the gradient is taken with respect to.
      policy: what ``jaxamp.get_policy`` takes (a ``jaxamp.Policy``, a ``jmp.Policy``
        or a policy string; ``fun`` runs under ``jaxamp.autocast``), or the
        mixed-precision version of ``fun``. Required, given by keyword, as to the
        other numerics tools.
      has_aux: whether the losses return ``(loss, aux)``.
      loss_scale: differentiate the policy's loss times this scale (a number or an
        optimizer state with ``jaxamp.loss_scaled``), as a float16 step does, and
        divide its gradients by it before comparing; ``None``: no scaling. Without
        it, float16 gradients below its range flush to zero and show as divergence.
      grad: ``False`` compares the forward pass alone (``fun`` may then return
        anything; ``NumericsDiff.gradients`` is empty, and ``loss`` is ``None`` unless
        ``fun`` returns a scalar).

    Raises:
      ValueError: without a policy.

    Returns:
      A function of the losses' arguments returning a ``NumericsDiff``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxamp
      >>> def loss(params, x):
      ...     with jax.named_scope("dense"):
      ...         h = jnp.tanh(x @ params["dense"]["kernel"])
      ...     return jnp.mean(h**2)
      >>> params = {"dense": {"kernel": jax.random.normal(jax.random.key(0), (64, 64))}}
      >>> x = jax.random.normal(jax.random.key(1), (8, 64))
      >>> diff = jaxamp.numerics_diff(loss, policy="mixed_bfloat16")(params, x)
      >>> top = diff.worst(1)[0]
      >>> top.layer, top.phase
      ('dense', 'backward')
      >>> 0 < top.relative_error < 0.1
      True
    """
    if policy is None:
        raise ValueError(
            "numerics_diff needs the policy to compare with float32: "
            "numerics_diff(fun, policy='mixed_bfloat16') (a jaxamp.Policy, a policy string, "
            "or the mixed-precision version of fun)."
        )
    amp_fun, _ = tracing.under_policy(fun, policy)
    scale = scale_of(loss_scale)

    def diff(*args: Any, **kwargs: Any) -> NumericsDiff:
        ref = measure(fun, args, kwargs, argnums=argnums, has_aux=has_aux, grad=grad)
        amp = measure(
            amp_fun, args, kwargs, argnums=argnums, has_aux=has_aux, grad=grad, loss_scale=scale
        )
        return compare_runs(ref, amp)

    return diff


@dataclasses.dataclass(frozen=True)
class Measured:
    """One run of a loss as ``numerics_diff`` compares it: each layer's last forward
    value, and the outputs (``(value, gradients)`` with ``grad``; the gradients divided
    by the loss scale the run was given)."""

    last: dict[str, Any]
    outputs: Any
    argnums: int | Sequence[int]
    has_aux: bool
    grad: bool


def measure(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    grad: bool = True,
    loss_scale: float | None = None,
) -> Measured:
    """``fun`` on ``args`` measured for ``compare_runs`` (``numerics_diff`` measures the
    float32 loss and the policy's, then compares them; a caller comparing many policies
    with one float32 loss measures that once)."""
    traced = tracing.trace(
        fun, argnums, args, kwargs or {}, has_aux=has_aux, loss_scale=loss_scale, grad=grad
    )
    last, flat = _last_values(traced)
    outputs = jax.tree.unflatten(traced.out_tree, flat)
    if loss_scale is not None and grad:  # the loss and gradients, unscaled
        outputs = jax.tree.map(lambda v: np.asarray(v, np.float64) / loss_scale, outputs)
    return Measured(last, outputs, argnums, has_aux, grad)


def compare_runs(ref: Measured, amp: Measured) -> NumericsDiff:
    """Where ``amp`` departs from the float32 ``ref``, layer by layer (both measured
    with the same ``argnums``, ``has_aux`` and ``grad``)."""
    if (ref.argnums, ref.has_aux, ref.grad) != (amp.argnums, amp.has_aux, amp.grad):
        raise ValueError(
            "compare_runs needs two runs measured alike: argnums, has_aux, grad "
            f"{(ref.argnums, ref.has_aux, ref.grad)} against "
            f"{(amp.argnums, amp.has_aux, amp.grad)}."
        )
    compared = [_pair(layer, "forward", amp.last.get(layer), v) for layer, v in ref.last.items()]
    if not ref.grad:
        losses = _losses(ref.outputs, amp.outputs, ref.has_aux)
        return NumericsDiff(tuple(_layer_diffs(compared)), (), losses)
    grads, backward = _gradient_pairs(ref.outputs[1], amp.outputs[1], ref.argnums, ref.last)
    layers = _layer_diffs(compared + backward)
    losses = _losses(ref.outputs[0], amp.outputs[0], ref.has_aux)
    return NumericsDiff(tuple(layers), tuple(grads), losses)


def _losses(ref: Any, amp: Any, has_aux: bool) -> tuple[float, float] | None:
    """``(float32 loss, policy loss)`` of the two runs' values; ``None`` if not scalars."""
    ref, amp = (ref[0], amp[0]) if has_aux else (ref, amp)
    if np.shape(ref) != () or np.shape(amp) != ():
        return None
    return float(ref), float(amp)


def _gradient_pairs(
    ref_grads: Any, amp_grads: Any, argnums: int | Sequence[int], ref_last: dict[str, Any]
) -> tuple[list[tuple[str, float | None]], list[_Pair]]:
    """Each gradient leaf's relative error, and each layer's gradients compared at once
    (its parameters' gradients, concatenated)."""
    grads: list[Any] = []
    by_layer: dict[str, Any] = {}
    paths = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
    single = isinstance(argnums, int)
    for (path, g), a in zip(paths, jax.tree.leaves(amp_grads), strict=True):
        grads.append((jax.tree_util.keystr(path), _relative(a, g)))
        by_layer.setdefault(_owner(path, single), []).append((g, a))
    root = common_root(ref_last)
    pairs = []
    for owner, leaves in by_layer.items():
        ref_flat = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g, _ in leaves])
        amp_flat = np.concatenate([np.ravel(np.asarray(a, np.float64)) for _, a in leaves])
        name = "/".join(p for p in (root, owner) if p)
        pairs.append(_pair(name, "backward", amp_flat, ref_flat))
    return grads, pairs
