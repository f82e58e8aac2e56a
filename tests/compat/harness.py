"""What the compatibility suite checks on each third-party model, in one place.

A model enters as ``loss(params, batch) -> float32 scalar`` built two ways: the
float32 model as its authors wrote it, and the same model under jaxamp (through
``apply_policy`` or ``autocast``). :func:`check_model` then

1. audits the mixed-precision program (loss and gradient): no sensitive
   operation in 16 bits, no float32 matmul, no matmul accumulating in 16 bits
   (``PrecisionReport.check``), and at least one matmul on compute-dtype operands;
2. checks that the gradients are float32, and close to the float32 model's;
3. trains both for 3 steps with ``jaxamp.loss_scaled(optax.adam)`` (the float32
   model with plain ``optax.adam``): params stay float32, at least one step is
   taken, and every step's loss is within 2% of the float32 model's.

The float32 model's gradients and losses are computed once per (package, model,
learning rate) and reused by every policy, path and form of that model: each
test builds the same float32 model with the same params and batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

STEPS = 3
LOSS_RTOL = 0.02
POLICIES = ("mixed_bfloat16", "mixed_float16")


@dataclasses.dataclass(frozen=True)
class Checked:
    """What one model passed, for the summary."""

    package: str
    model: str
    path: str
    policy: str
    matmuls: int
    sensitive_float32: int
    losses: tuple[float, ...]
    reference: tuple[float, ...]


def _float_leaves(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]


def _train(loss: Callable, params: Any, batch: Any, tx: optax.GradientTransformation, scaled: bool):
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        if scaled:
            value, grads = jaxamp.value_and_grad(loss)(params, batch, opt_state=state)
        else:
            value, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(STEPS):
        params, state, value = step(params, state, batch)
        losses.append(float(value))
    return params, state, losses


_REFERENCES: dict[tuple[str, str, float], tuple[Any, list[float]]] = {}


def _reference(key, fp32_loss: Callable, params: Any, batch: Any, learning_rate: float):
    """The float32 model's gradients and 3-step losses, computed once per ``key``."""
    if key not in _REFERENCES:
        grads = jax.jit(jax.grad(fp32_loss))(params, batch)
        _, _, losses = _train(fp32_loss, params, batch, optax.adam(learning_rate), scaled=False)
        _REFERENCES[key] = grads, losses
    return _REFERENCES[key]


def check_model(
    *,
    package: str,
    model: str,
    path: str,
    policy: str,
    amp_loss: Callable,
    fp32_loss: Callable,
    params: Any,
    batch: Any,
    learning_rate: float = 1e-3,
    grad_rtol: float | None = None,
) -> Checked:
    """Runs the checks of the module docstring; returns what passed."""
    compute = jaxamp.get_policy(policy).compute_dtype
    report = jaxamp.precision_report(jax.value_and_grad(amp_loss))(params, batch)
    report.check(compute)
    assert report.count(compute.name) >= 1, report
    sensitive32 = sum(op.dtype == "float32" for op in report.sensitive)
    assert sensitive32 >= 1, "no sensitive operation found: the audit read nothing"

    grads = jax.jit(jax.grad(amp_loss))(params, batch)
    assert {g.dtype for g in _float_leaves(grads)} == {np.dtype("float32")}
    reference_grads, reference = _reference(
        (package, model, learning_rate), fp32_loss, params, batch, learning_rate
    )
    rtol = grad_rtol if grad_rtol is not None else (0.1 if compute.name == "bfloat16" else 0.03)
    scale = max(float(jnp.max(jnp.abs(g))) for g in _float_leaves(reference_grads))
    for ours, theirs in zip(_float_leaves(grads), _float_leaves(reference_grads), strict=True):
        assert float(jnp.max(jnp.abs(ours - theirs))) <= rtol * scale

    trained, state, losses = _train(
        amp_loss, params, batch, jaxamp.loss_scaled(optax.adam(learning_rate)), scaled=True
    )
    assert {p.dtype for p in _float_leaves(trained)} == {np.dtype("float32")}
    assert int(state.skipped_steps) < STEPS, "every step was skipped"
    np.testing.assert_allclose(losses, reference, rtol=LOSS_RTOL)
    return Checked(
        package, model, path, policy, len(report.ops), sensitive32, tuple(losses), tuple(reference)
    )
