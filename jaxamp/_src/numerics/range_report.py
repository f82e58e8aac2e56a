"""``range_report``: per layer, how large and how small the values of a step are."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxamp._src.dtypes import is_float16, is_inexact_array, is_narrow_array
from jaxamp._src.numerics import evaluator, sites, tracing
from jaxamp._src.numerics.find_nonfinite import (
    CONSTANT,
    carried,
    constant,
    merge_tags,
    scale_of,
)
from jaxamp._src.numerics.ranges import LayerRange, RangeReport, Recommendation, beyond_float16
from jaxamp._src.policy import PolicyLike

__all__ = ["LayerRange", "RangeReport", "Recommendation", "range_report"]


class _Accumulator:
    """Running statistics of one (layer, phase)."""

    def __init__(self) -> None:
        self.max_abs, self.size, self.nonzero = 0.0, 0, 0
        self.below_normal, self.below_subnormal = 0, 0
        self.nonfinite, self.nonfinite_float32 = 0, 0

    def add(self, x: Any, wide: bool) -> None:
        """Counts the values of ``x``; ``wide``: its infs and NaNs were made in float32."""
        raw = np.asarray(x)
        a = np.abs(raw.astype(np.float64)).ravel()
        if is_inexact_array(raw):
            # a value at exactly its dtype's largest magnitude is a sentinel, not data: the
            # -finfo.max an attention mask fills in, which follows the compute dtype
            a = a[a != float(jnp.finfo(raw.dtype).max)]
        ok = np.isfinite(a)
        bad = int(a.size - ok.sum())
        self.nonfinite += bad
        if wide:
            self.nonfinite_float32 += bad
        a = a[ok]
        self.size += a.size
        if a.size:
            self.max_abs = max(self.max_abs, float(a.max()))
        nonzero = a[a > 0]
        self.nonzero += nonzero.size
        with np.errstate(over="ignore"):
            held = nonzero.astype(np.float16)  # as float16 rounds them
        self.below_normal += int((held < np.finfo(np.float16).tiny).sum())  # 2**-14
        self.below_subnormal += int((held == 0).sum())  # 2**-25 too: a tie, to even

    def result(self, layer: str, phase: str) -> LayerRange:
        n = max(self.nonzero, 1)
        return LayerRange(
            layer,
            phase,
            self.max_abs,
            self.size,
            self.below_normal / n,
            self.below_subnormal / n,
            self.nonfinite,
            self.nonfinite_float32,
        )


_WIDE, _NARROW = "float32", "16-bit"  # where an inf or a NaN was first made


class _Measure:
    """A ``sites.Tagger`` that adds each value counted (``counted(sixteen_bit)``) to
    its (layer, phase) statistics, and follows each inf and NaN to the operation that
    made it: one whose output is held in float32 (or computed there, for a policy),
    which float16 is not the cause of, or in 16 bits. A value's tag is the set of
    those (``_WIDE``, ``_NARROW``) its infs and NaNs come from, ``CONSTANT`` or ``None``."""

    constant = CONSTANT

    def __init__(self, counted: Callable[[bool], bool]):
        self.counted = counted
        self.stats: dict[tuple[str, str], _Accumulator] = {}
        self.nonfinite: list[tuple[str, str]] = []  # (layer, phase), in the order made

    def op(
        self,
        site: sites.Site,
        tags: Sequence[Any],
        inputs: Sequence[Any],
        outputs: Sequence[Any],
    ) -> tuple[list[Any], bool]:
        bad = [not evaluator.finite(o) for o in outputs]
        out_tags: list[Any]
        if constant(tags, inputs, bad):
            out_tags = [CONSTANT] * len(outputs)
        elif not any(bad):
            out_tags = [None] * len(outputs)
        else:
            came_from = carried(tags) or self._made(site, inputs, outputs, bad)
            out_tags = [came_from if b else None for b in bad]
        if sites.LOSS_SCALE_SCOPE not in site.name_stack:  # the loss times the scale: not
            self._count(site, outputs, out_tags)  # a value of the model
        return out_tags, False

    def merge(self, tags: Sequence[Any]) -> Any:
        return merge_tags(tags)

    @staticmethod
    def _made(
        site: sites.Site, inputs: Sequence[Any], outputs: Sequence[Any], bad: list[bool]
    ) -> frozenset[str]:
        """Where an operation that makes a new inf or NaN makes it. In float32 when its
        output is held there; when, made of finite 16-bit inputs, it is not finite
        computed in float32 either (``log(0)``); or when fed an inf or NaN constant
        that is not float16 (bfloat16 holds what float32 holds: its inf is meant, a
        ``-inf`` mask fill). Else in 16 bits: an overflow, or a float16 constant that
        may be a value float16 rounded to inf (a mask of ``1e30``) as well as a
        ``-inf`` meant."""
        if all(not is_narrow_array(o) for o, b in zip(outputs, bad, strict=True) if b):
            return frozenset({_WIDE})
        fed = [i for i in inputs if not evaluator.finite(i)]
        if fed:
            meant = not any(is_float16(i.dtype) for i in fed)
            return frozenset({_WIDE if meant else _NARROW})
        if site.eqn is not None:
            with contextlib.suppress(Exception):
                wide = evaluator.in_float32(site, inputs)
                if all(not evaluator.finite(w) for w, b in zip(wide, bad, strict=True) if b):
                    return frozenset({_WIDE})
        return frozenset({_NARROW})

    def _count(self, site: sites.Site, outputs: Sequence[Any], tags: Sequence[Any]) -> None:
        key = (site.layer, site.phase)
        for out, sixteen, tag in zip(outputs, site.sixteen_bit, tags, strict=True):
            if is_inexact_array(out) and self.counted(sixteen):
                # a constant's inf or NaN is meant unless float16 may have rounded it
                made = tag
                if not isinstance(tag, frozenset):
                    made = {_NARROW if is_float16(out.dtype) else _WIDE}
                wide = made == {_WIDE}
                self.stats.setdefault(key, _Accumulator()).add(out, wide)
                if key not in self.nonfinite and self.stats[key].nonfinite:
                    self.nonfinite.append(key)


def range_report(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    policy: PolicyLike | Callable[..., Any] | None = None,
    has_aux: bool = False,
    loss_scale: Any = None,
    grad: bool = True,
) -> Callable[..., RangeReport]:
    """Per layer, the largest |activation| and |gradient| of one step, and how many
    values float16 could not hold.

    ``jaxamp.range_report(loss_fn)(params, batch)`` evaluates the loss and its gradient
    as ``jaxamp.find_nonfinite`` does (one primitive at a time, under the model's
    own policy) and records every floating value each layer computes. Run the model
    in float32 (or bfloat16) on one calibration batch to learn whether float16 will
    hold it; ``.overflows("float16")`` lists the layers that exceed 65504 and
    ``.recommend()`` says whether float16 with loss scaling is safe, with which loss
    scale, or bfloat16 is needed. It counts every value a layer computes,
    intermediates included (a policy may keep some in float32, such as the cube inside
    tanh-GELU), but not the multiplication of the loss by ``loss_scale``. Slow; for
    debugging, not for training steps.

    Args:
      fun: the loss (a floating scalar; ``(loss, aux)`` with ``has_aux``). A function
        returning anything else (activations) is measured forward only, with a
        warning: ``RangeReport.forward_only`` says so.
      argnums: what the gradient is taken with respect to.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      loss_scale: a number or an optimizer state with ``jaxamp.loss_scaled``: the
        gradients are those of the loss times this scale, as float16 would see them
        (the loss scaled as ``jaxamp.scale_loss`` scales it). When a gradient
        overflows float16 at this scale, the gradients are measured unscaled too
        (``RangeReport.unscaled``), to name a scale that fits.
      policy: the mixed-precision policy you mean to train with (a
        ``jaxamp.Policy``, a ``jmp.Policy`` or a string: ``fun`` runs under
        ``jaxamp.autocast``),
        or the mixed-precision version of ``fun`` itself. Then only the values that
        policy computes in 16 bits are counted, each computed in float32 so that its
        size shows: LayerNorm statistics, softmax and the other work a policy keeps
        in float32 cannot overflow float16 and are left out. ``None`` (default): every
        value of ``fun`` as it runs.
      grad: ``False`` measures the forward pass alone (``fun`` may then return
        anything; ``RangeReport.forward_only`` says so).

    Returns:
      A function of ``fun``'s arguments returning a ``RangeReport``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxamp
      >>> def loss(w, x):
      ...     with jax.named_scope("big"):
      ...         h = x @ w
      ...     return jnp.mean(h**2)
      >>> report = jaxamp.range_report(loss)(jnp.full((4, 4), 3e4), jnp.ones((2, 4)))
      >>> sorted({(r.layer, r.phase) for r in report.overflows("float16")})
      [('', 'backward'), ('', 'forward'), ('big', 'forward')]
      >>> report.recommend().dtype
      'bfloat16'
      >>> small = jnp.full((4, 4), 0.5)  # fits float16, but not at a loss scale of 2**24
      >>> advice = jaxamp.range_report(loss, loss_scale=2.0**24)(small, jnp.ones((2, 4)))
      >>> advice = advice.recommend()
      >>> advice.dtype, advice.loss_scale
      ('float16', 8192.0)
    """
    scale = scale_of(loss_scale)
    target, described = tracing.under_policy(fun, policy)

    def measure(args: tuple[Any, ...], kwargs: dict[str, Any], scale: Any) -> RangeReport:
        traced, forward_only = tracing.trace_or_forward(
            "range_report",
            target,
            argnums,
            args,
            kwargs,
            has_aux=has_aux,
            loss_scale=scale,
            grad=grad,
        )
        measured = _Measure(counted=lambda sixteen: sixteen or described is None)
        evaluator.run(
            traced.jaxpr,
            traced.args,
            lambda *_: None,
            traced.primal_outputs,
            widen=described is not None,
            tagger=measured,
        )
        layers = tuple(acc.result(layer, phase) for (layer, phase), acc in measured.stats.items())
        return RangeReport(
            layers, scale, described, nonfinite=tuple(measured.nonfinite), forward_only=forward_only
        )

    def report(*args: Any, **kwargs: Any) -> RangeReport:
        result = measure(args, kwargs, scale)
        phases = {r.phase for r in result.layers if beyond_float16(r)}
        if scale is not None and scale > 1 and phases == {"backward"}:
            # too large a scale, or gradients float16 cannot hold? measure them unscaled
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                unscaled = measure(args, kwargs, None)
            rows = tuple(r for r in unscaled.layers if r.phase == "backward")
            result = dataclasses.replace(result, unscaled=rows)
        return result

    return report
