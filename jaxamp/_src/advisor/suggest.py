"""``suggest_policy``: the cheapest policy, with per-layer overrides, that a model's own
numbers support on a batch."""

from __future__ import annotations

import dataclasses
import glob
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import numpy as np

from jaxamp._src.advisor import targets
from jaxamp._src.advisor.float8 import flushed_shares
from jaxamp._src.backend import candidate_policies
from jaxamp._src.dtypes import is_float16
from jaxamp._src.numerics import divergence_view, floors, numerics_diff
from jaxamp._src.numerics.range_report import range_report
from jaxamp._src.numerics.ranges import beyond_float16
from jaxamp._src.numerics.tracing import NotALoss
from jaxamp._src.optim.scales import DynamicLossScale
from jaxamp._src.policy import PRESETS, Policy, PolicyLike, get_policy

FLOAT32 = "float32"  # what an override keeps a layer in


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate policy as ``suggest_policy`` measured it.

    Attributes:
      policy: the candidate, by name (a preset's, or the policy's string).
      accepted: whether it holds with ``overrides``.
      verdict: one line: why it was accepted or refused.
      overrides: the layers it keeps in float32 (a layer's path, as the ``overrides`` of
        ``jaxamp.linen.apply_policy``, ``jaxamp.nnx.apply_policy`` and ``jaxamp.autocast``
        take it) -> ``"float32"``.
      reasons: per override, the measurement that asked for it, in one line.
      loss_scale: the loss scale a float16 candidate's gradients were measured at;
        ``None`` for the others.
      rows: per layer and pass, the evidence of the last measurement: the rows of
        ``jaxamp compare``'s divergence check (``layer``, ``phase``, ``scale_error``,
        its ``floor``, ``flagged`` and the ``fault`` that says why).
      measurements: how many times the model was run under the candidate.
      first_rows: the rows of the first measurement, with no layer kept in float32
        (where the faults show); ``rows`` again when nothing was kept.
    """

    policy: str
    accepted: bool
    verdict: str
    overrides: Mapping[str, str]
    reasons: Mapping[str, str]
    loss_scale: float | None
    rows: tuple[dict[str, Any], ...]
    measurements: int
    first_rows: tuple[dict[str, Any], ...] = ()

    def runs(self) -> list[dict[str, Any]]:
        """The measurements to show, as ``jaxamp compare``'s report holds its variants: the
        candidate as it is, and with its overrides when it has any."""
        if not self.rows:
            return []
        if not self.overrides or not self.first_rows:
            return [{"variant": self.policy, "divergence": list(self.rows)}]
        return [
            {"variant": f"{self.policy} as it is", "divergence": list(self.first_rows)},
            {"variant": f"{self.policy} with overrides", "divergence": list(self.rows)},
        ]


@dataclasses.dataclass(frozen=True)
class PolicySuggestion:
    """What ``suggest_policy`` found: the policy to train with and the evidence.

    Attributes:
      policy: the cheapest candidate that held (``"float32"`` when none did); its
        ``str`` parses back with ``jaxamp.get_policy``.
      overrides: the layers to keep in float32, as ``apply`` passes them.
      reasons: per override, why, in one line.
      loss_scale: under float16, the largest loss scale whose gradients fit on the
        batch (start ``jaxamp.DynamicLossScale`` at or below it); else ``None``.
      trials: every candidate measured, cheapest first.
    """

    policy: Policy
    overrides: Mapping[str, str]
    reasons: Mapping[str, str]
    loss_scale: float | None
    trials: tuple[Trial, ...]

    def apply(self, target: Any) -> Any:
        """``target`` under the suggested policy and overrides: a Linen module through
        ``jaxamp.linen.apply_policy``, an NNX module through ``jaxamp.nnx.apply_policy``
        (in place), any other function through ``jaxamp.autocast``."""
        return targets.apply(target, self.policy, dict(self.overrides))

    def __str__(self) -> str:
        name = _name(self.policy)
        lines = [f"Suggested policy: {name} ({self.policy})"]
        if self.loss_scale is not None:
            lines.append(f"  with loss scaling, from a scale of at most {self.loss_scale:g}")
        for layer, reason in self.reasons.items():
            lines.append(f"  {layer} -> {self.overrides[layer]}: {reason}")
        lines += [f"{t.policy}: {t.verdict}" for t in self.trials]
        return "\n".join(lines)

    def table(self, limit: int = 12) -> str:
        """A markdown table: the ``limit`` layers that stand highest over their floor, each
        candidate's error (its floor), flagged rows marked ⚠."""
        runs = [run for t in self.trials for run in t.runs()]
        if not runs:
            return "No candidate was measured layer by layer."
        return "\n".join(divergence_view.divergence_table(runs, limit)).strip()

    def plot(self, path: str | Path) -> None:
        """Draws each candidate's errors and floors per layer, forward and backward, as
        ``jaxamp compare``'s divergence.png does, to ``path`` (a PNG)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        runs = [run for t in self.trials for run in t.runs()]

        def save(fig: Any, _: str) -> None:
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)

        divergence_view.plot({"runs": runs}, Path(path).parent, save)


def _name(policy: Policy) -> str:
    return next((name for name, p in PRESETS.items() if p == policy), str(policy))


def suggest_policy(
    loss: Callable[..., Any],
    *args: Any,
    model: nn.Module | None = None,
    candidates: Sequence[PolicyLike] | None = None,
    tolerance: float = floors.FLAG_RATIO,
    max_overridden: float = 0.5,
    max_rounds: int = 8,
    max_float8_flush: float = 0.01,
    progress: bool = True,
) -> PolicySuggestion:
    """Measures a model against float32 and returns the cheapest policy, with the layers
    it must keep in float32, under which every layer stays near its floor.

    Each candidate (cheapest first) is measured on ``args`` as ``jaxamp compare``'s
    divergence check measures a variant: per layer, the error of its output and of its
    parameters' gradients against float32, beside the floor (the error of the rounding no
    recipe of that precision avoids). A layer more than ``tolerance`` times its floor, not
    finite where float32 is, or flushed to zero, is kept in float32 and the model
    measured again, until nothing is flagged (a fault outside any layer, in the model's
    own code around its layers or in the loss, or in a layer kept already, is taken for
    the layer whose output comes before it). Then each layer kept is tried back in the
    candidate's precision, and stays there if nothing is flagged without it. A float16
    candidate is first checked for range: a layer whose activations exceed float16's
    largest value is kept in float32, and the gradients must fit a loss scale
    (``jaxamp.range_report``). A candidate is refused when a fault stays flagged with
    the layers before it in float32, or when more than ``max_overridden`` of the layers
    would be. The first candidate that holds is the suggestion; ``"float32"`` when none
    does.

    Cost: per candidate, two floor runs, then one run per round (a round per fault
    found) and one per layer tried back, beside one float32 run in all; each is one
    forward and backward pass of ``loss``, compiled.

    Args:
      loss: the float32 loss, a scalar. Its gradient is taken with respect to its first
        argument (the params, or an NNX model). With ``model``: ``loss(model, *args)``.
      *args: the arguments, a batch included: as training sees them.
      model: a Flax Linen module, for a ``loss`` that calls ``model.apply``: each
        candidate runs as ``jaxamp.linen.apply_policy`` runs it. An NNX model is passed
        as the first of ``args`` (each candidate runs a copy under
        ``jaxamp.nnx.apply_policy``); without either, ``loss`` runs under
        ``jaxamp.autocast``.
      candidates: the policies to try, cheapest first; ``None``: those the default
        device computes (``candidate_policies``: on a CPU ``mixed_bfloat16`` and
        ``mixed_float16``).
      tolerance: how many times its floor a layer's error may be (``jaxamp compare``'s
        ``FLAG_RATIO``).
      max_overridden: the largest share of the layers a candidate may keep in float32.
      max_rounds: the most measurements per candidate after the first.
      max_float8_flush: under a float8 candidate, the largest share of a GEMM operand's
        nonzero values that its per-tensor scale may round to zero (a layer above it is
        kept in float32, measured on ``loss`` as written: ``flushed_shares``).
      progress: show a progress bar (with ``tqdm`` installed).

    Returns:
      A ``PolicySuggestion``.

    Raises:
      TypeError: for a ``model`` that is not a Linen module.
      ValueError: for a candidate that names no policy, or under delayed float8 scaling.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxamp
      >>> def loss(params, x):
      ...     with jax.named_scope("dense"):
      ...         h = jnp.tanh(x @ params["kernel"])
      ...     return jnp.mean(h**2)
      >>> params = {"kernel": jax.random.normal(jax.random.key(0), (32, 32)) / 6}
      >>> x = jax.random.normal(jax.random.key(1), (8, 32))
      >>> advice = jaxamp.suggest_policy(loss, params, x, progress=False)
      >>> advice.policy == jaxamp.get_policy("mixed_bfloat16"), dict(advice.overrides)
      (True, {})
    """
    target = targets.make(loss, args, model)
    policies = [get_policy(c) for c in (candidate_policies() if candidates is None else candidates)]
    for policy in policies:
        if policy.fp8 is not None and policy.fp8.scaling == "delayed":
            raise ValueError(
                f"suggest_policy measures float8 with current scaling; the candidate {policy} "
                "scales from a history of earlier steps, which one batch does not have. "
                "Try 'mixed_float8' (its GEMMs are the same, scaled from this step)."
            )
    bar = _progress(progress)
    ref_fun, ref_args = target.reference()
    try:
        measured = numerics_diff.measure(ref_fun, ref_args)
    except NotALoss as e:
        raise TypeError(
            "suggest_policy measures a loss: it must return a floating scalar, whose "
            f"gradient is taken with respect to its first argument; got {e.returned}. A loss "
            "returning (loss, aux) is passed as lambda *args: loss(*args)[0]."
        ) from None
    bar.update()
    trials = []
    try:
        for policy in policies:
            limits = (tolerance, max_overridden, max_float8_flush)
            trial = _Trial(target, policy, measured, limits, bar).run(max_rounds)
            trials.append(trial)
            if trial.accepted:
                return PolicySuggestion(
                    policy, trial.overrides, trial.reasons, trial.loss_scale, tuple(trials)
                )
    finally:
        bar.close()
    return PolicySuggestion(get_policy(FLOAT32), {}, {}, None, tuple(trials))


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(show: bool) -> Any:
    if not show:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the progress bar is optional
        return _NoBar()
    return tqdm(desc="suggest_policy", unit=" runs")


class _Trial:
    """Measures one candidate, keeping layers in float32 until nothing is flagged."""

    def __init__(
        self,
        target: targets.Target,
        policy: Policy,
        measured: numerics_diff.Measured,
        limits: tuple[float, float, float],
        bar: Any,
    ):
        """``limits``: ``suggest_policy``'s tolerance, max_overridden, max_float8_flush."""
        self.target, self.policy, self.measured, self.bar = target, policy, measured, bar
        self.tolerance, self.max_overridden, self.max_float8_flush = limits
        self.name = _name(policy)
        self.root = numerics_diff.common_root(measured.last)
        self.layers = {k for k in map(self._key, measured.last) if k is not None}
        self.overrides: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.loss_scale: float | None = None
        self.rows: list[dict[str, Any]] = []
        self.first_rows: list[dict[str, Any]] = []
        self.runs = 0

    def _key(self, layer: str) -> str | None:
        """A layer's path as overrides take it (below the model's root); ``None`` for the
        root itself and code outside any layer, which no override can keep apart."""
        if not layer or layer == self.root:
            return None
        path = layer[len(self.root) + 1 :] if self.root else layer
        return glob.escape(path)  # overrides are glob patterns: ``blk[0]`` is a name here

    def _mixed(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        self.runs += 1
        self.bar.set_postfix_str(f"{self.name}, {len(self.overrides)} kept in float32")
        self.bar.update()
        return self.target.mixed(self.policy, dict(self.overrides))

    def _result(self, accepted: bool, verdict: str) -> Trial:
        return Trial(
            self.name,
            accepted,
            verdict,
            dict(self.overrides),
            dict(self.reasons),
            self.loss_scale,
            tuple(self.rows),
            self.runs,
            tuple(self.first_rows or self.rows),
        )

    def _keep(self, key: str, reason: str) -> str | None:
        """Keeps a layer in float32; the refusal when that is too many layers."""
        self.overrides[key], self.reasons[key] = FLOAT32, reason
        if len(self.overrides) > self.max_overridden * len(self.layers):
            return (
                f"refused: it would keep {len(self.overrides)} of {len(self.layers)} layers in "
                f"float32 (more than {self.max_overridden:.0%})"
            )
        return None

    def run(self, max_rounds: int) -> Trial:
        if is_float16(self.policy.compute_dtype) or is_float16(self.policy.param_dtype):
            refused = self._fit_float16(max_rounds)
            if refused:
                return self._result(False, refused)
        ref_fun, ref_args = self.target.reference()
        if self.policy.fp8 is not None and self.policy.fp8.block is None:
            # per-tensor scaling's flush check: block scales confine an outlier to its block
            refused = self._fit_float8(ref_fun, ref_args)
            if refused:
                return self._result(False, refused)
        dtype = floors.rounding_dtype(self.policy)
        inputs = floors.input_sensitivity(ref_fun, dtype, *ref_args, measured=self.measured)
        ideal = floors.ideal_rounding(
            ref_fun, self.policy, *ref_args, loss_scale=self.loss_scale, measured=self.measured
        )
        self.bar.update(2)
        ranged = set(self.overrides)  # kept for float16's or float8's range: not tried back
        for _ in range(max_rounds + 1):
            flagged = self._measure(inputs, ideal)
            if not flagged:
                self._try_back(inputs, ideal, ranged)
                kept = f", {len(self.overrides)} layers kept in float32" if self.overrides else ""
                return self._result(True, f"accepted: no layer flagged{kept}")
            refused = self._keep_flagged(flagged)
            if refused:
                return self._result(False, refused)
        return self._result(False, f"refused: still flagged after {max_rounds} rounds")

    def _measure(self, inputs: Any, ideal: Any) -> list[dict[str, Any]]:
        """The candidate's rows with the overrides so far (kept in ``rows``); the flagged."""
        fun, args = self._mixed()
        rows = floors.divergence(self.measured, fun, *args, loss_scale=self.loss_scale)
        self.rows = floors.with_floor(rows, inputs, ideal, self.tolerance)
        if not self.first_rows and not self.overrides:
            self.first_rows = self.rows
        return [r for r in self.rows if r["flagged"] and not _cancelled(r)]

    def _try_back(self, inputs: Any, ideal: Any, ranged: set[str]) -> None:
        """Tries each layer kept for its error back in the candidate's precision, the last
        kept first; it stays there when nothing is flagged without it (a layer kept on
        the way to the fault upstream of it)."""
        accepted = self.rows
        for key in [k for k in reversed(self.overrides) if k not in ranged]:
            override, reason = self.overrides.pop(key), self.reasons.pop(key)
            if self._measure(inputs, ideal):
                self.overrides[key], self.reasons[key] = override, reason
            else:
                accepted = self.rows
        self.rows = accepted

    def _keep_flagged(self, flagged: list[dict[str, Any]]) -> str | None:
        """Keeps the first flagged forward layer in float32 (those after it may be its
        consequence), or with none flagged forward every flagged backward one; the
        refusal when there is nothing an override could change."""
        forward = [r for r in flagged if r["phase"] == "forward"]
        if forward:
            first = forward[0]
            if self._free(first):
                return self._keep(self._key(first["layer"]) or "", self._reason(first))
            if self._upstream(first["layer"]) is not None:
                return self._keep_upstream_of(first)
            # nothing before it: a layer run twice (shared, scanned) shows its first pass's
            # fault in its first layer's second output; the next flagged layer is the fault
            fresh = [r for r in forward if self._free(r)]
            if not fresh:
                return self._keep_upstream_of(first)
            return self._keep(self._key(fresh[0]["layer"]) or "", self._reason(fresh[0]))
        fresh = [r for r in flagged if self._free(r)]
        if not fresh:
            return self._keep_upstream_of(flagged[0])
        for row in fresh:
            refused = self._keep(self._key(row["layer"]) or "", self._reason(row))
            if refused:
                return refused
        return None

    def _free(self, row: dict[str, Any]) -> bool:
        """Whether a row's layer can be kept in float32 and is not yet."""
        key = self._key(row["layer"])
        return key is not None and key not in self.overrides

    def _reason(self, row: dict[str, Any]) -> str:
        return f"{_evidence(row, self.tolerance)} under {self.name}"

    def _keep_upstream_of(self, row: dict[str, Any]) -> str | None:
        """For a flagged forward value no override can change (its layer kept already, or
        none: the model's own code around its layers, the loss), keeps the layer whose
        output the forward pass makes last before it; the refusal when there is none."""
        evidence = _evidence(row, self.tolerance)
        key = self._key(row["layer"])
        upstream = self._upstream(row["layer"]) if row["phase"] == "forward" else None
        if upstream is None:
            where = "with its layer in float32" if key else "outside any layer"
            return f"refused: {_where(row)} stays flagged {where} ({evidence})"
        what = f"{key}, flagged with itself in float32" if key else f"{_where(row)}, flagged"
        return self._keep(upstream, f"upstream of {what} ({evidence}), under {self.name}")

    def _upstream(self, layer: str) -> str | None:
        """The layer the forward pass runs last before ``layer`` and not yet kept in
        float32, or ``None``."""
        order = list(self.measured.last)
        before = order[: order.index(layer)] if layer in order else []
        keys = [self._key(name) for name in reversed(before)]
        return next((k for k in keys if k is not None and k not in self.overrides), None)

    def _fit_float8(self, ref_fun: Callable[..., Any], ref_args: tuple[Any, ...]) -> str | None:
        """Keeps the layers whose GEMM operands float8 would flush beyond
        ``max_float8_flush`` in float32; the refusal when one lies outside any layer."""
        self.bar.update()
        for layer, share in flushed_shares(ref_fun, ref_args).items():
            if share <= self.max_float8_flush:
                continue
            what = (
                f"float8 e4m3 would round {share:.0%} of a GEMM operand's nonzero values to "
                f"zero (scaled per tensor from its largest; at most {self.max_float8_flush:.0%})"
            )
            key = self._key(layer)
            if key is None:
                return f"refused: {what}, outside any layer"
            refused = self._keep(key, f"{what}, under {self.name}")
            if refused:
                return refused
        return None

    def _fit_float16(self, max_rounds: int) -> str | None:
        """Keeps the layers whose activations exceed float16's range in float32 and finds
        the loss scale the gradients fit; the refusal when they fit none."""
        initial = DynamicLossScale().init_scale
        for _ in range(max_rounds + 1):
            fun, args = self._mixed()
            report = range_report(fun, policy=fun, loss_scale=initial)(*args)
            beyond = [r for r in report.layers if r.phase == "forward" and beyond_float16(r)]
            if not beyond:
                advice = report.recommend()
                if advice.dtype != "float16":
                    return f"refused: {advice.reason}"
                self.loss_scale = advice.loss_scale or initial
                return None
            for row in beyond:
                key = self._key(row.layer)
                if key is None or key in self.overrides:
                    return (
                        f"refused: activations of {row.layer or '(outside any layer)'} reach "
                        f"{row.max_abs:.3g}, beyond float16's largest value (65504)"
                    )
                reason = (
                    f"activations reach {row.max_abs:.3g}, beyond float16's largest value "
                    f"(65504), under {self.name}"
                )
                refused = self._keep(key, reason)
                if refused:
                    return refused
        return f"refused: activations still beyond float16's range after {max_rounds} rounds"


def _cancelled(row: dict[str, Any]) -> bool:
    """Whether a row is the gradients of a layer that are about zero in float32 (a scale
    and bias a BatchNorm after them cancels): their error is rounding noise against
    nothing, which no layer kept in float32 restores. It stays in the evidence, flagged,
    and decides nothing."""
    return bool(row["near_zero"]) and row["phase"] == "backward"


def _where(row: dict[str, Any]) -> str:
    return f"{row['layer'] or '(no layer)'} {row['phase']}"


def _evidence(row: dict[str, Any], tolerance: float) -> str:
    """One line: what the row's measurement found."""
    fault, error, floor = row["fault"], row["scale_error"], row["floor"]
    if fault == "above its floor":
        times = error / floor if floor else np.inf
        return (
            f"{row['phase']} error {error:.2g} is {times:.3g}x its floor {floor:.2g} "
            f"(more than {tolerance:g}x)"
        )
    return f"{row['phase']} value {fault}"


__all__ = ["PolicySuggestion", "Trial", "suggest_policy"]
