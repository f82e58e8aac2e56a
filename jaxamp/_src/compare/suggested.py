"""The ``auto`` variant of ``jaxamp compare``: the policy ``jaxamp.suggest_policy`` measures
on the model's first batch, trained beside the others so that its claim is checked."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxamp._src.advisor.suggest import PolicySuggestion, suggest_policy
from jaxamp._src.backend import candidate_policies
from jaxamp._src.compare.task import Task
from jaxamp._src.compare.variants import AUTO, Variant
from jaxamp._src.dtypes import is_float16


def task_loss(task: Task, state: Any) -> Any:
    """The task's loss as ``suggest_policy`` takes it for a Linen model:
    ``loss(model, params, x, y)``, the cross-entropy of the logits in training mode
    (BatchNorm over the batch, ``state`` its statistics), dropout off."""

    def loss(model: Any, params: Any, x: Any, y: Any) -> Any:
        train = task.has_batch_stats  # batch statistics as training computes them
        logits, _ = task.apply(model, params, state, x, train, jax.random.key(0))
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss


def suggested_variant(
    task: Task, variables: dict[str, Any], sample: tuple[Any, Any]
) -> tuple[Variant, dict[str, Any]]:
    """The ``auto`` variant for ``task`` at ``variables``, measured on ``sample`` (the first
    training batch), and the suggestion as a record for the report."""
    loss = task_loss(task, variables.get("batch_stats", {}))
    advice = suggest_policy(
        loss, variables["params"], *sample, model=task.module, candidates=candidate_policies()
    )
    return variant_of(advice), record_of(advice)


def variant_of(advice: PolicySuggestion) -> Variant:
    """A variant training ``advice``'s policy and overrides (float16: with dynamic loss
    scaling, as the ``fp16`` variant)."""
    name = next((t.policy for t in advice.trials if t.accepted), "float32")
    kept = ", ".join(advice.overrides)
    description = f"suggested by jaxamp.suggest_policy: {name}" + (
        f", {kept} kept in float32" if kept else ""
    )
    float16 = is_float16(advice.policy.compute_dtype)
    overrides = tuple(advice.overrides.items())
    return Variant(AUTO, advice.policy, None, float16, description, overrides=overrides)


def record_of(advice: PolicySuggestion) -> dict[str, Any]:
    """What report.json keeps of a suggestion."""
    return {
        "policy": str(advice.policy),
        "overrides": dict(advice.overrides),
        "reasons": dict(advice.reasons),
        "loss_scale": advice.loss_scale,
        "verdicts": {t.policy: t.verdict for t in advice.trials},
    }
