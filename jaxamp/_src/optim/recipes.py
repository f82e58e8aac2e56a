"""Optimizer recipes: one optax chain per kind of policy, named."""

from __future__ import annotations

from typing import Any

import optax

from jaxamp._src.errors import invalid_choice
from jaxamp._src.optim.loss_scaled import loss_scaled
from jaxamp._src.optim.state_dtype import with_state_dtype
from jaxamp._src.policy import Policy, get_policy

# Named recipes: the params' policy and the optimizer wrapper, picked in one place.
OPTIMIZER_RECIPES = {
    "float32_params": ("mixed_bfloat16", "float32", None),
    "bf16_float32_master": ("p=bf16,c=bf16,o=f32", "float32", None),
    "bf16_kahan": ("p=bf16,c=bf16,o=f32", "kahan", None),
    "bf16_stochastic": ("p=bf16,c=bf16,o=f32", "stochastic", "bfloat16"),
    "bf16_naive": ("p=bf16,c=bf16,o=f32", "none", None),
}
"""The named recipes of ``optimizer_recipe``: ``name: (params' policy, master_weights,
state rounding dtype)``."""


def optimizer_recipe(
    name: str, inner: optax.GradientTransformation, **loss_scaled_kwargs: Any
) -> tuple[Policy, optax.GradientTransformationExtraArgs]:
    """``(policy, optimizer)`` of a named recipe of ``OPTIMIZER_RECIPES``.

    ``float32_params`` is standard AMP (float32 params, bfloat16 compute);
    the ``bf16_*`` recipes store params in bfloat16 and differ in how updates
    reach them (see ``loss_scaled``'s ``master_weights``); ``bf16_stochastic``
    also stores the optimizer's state in bfloat16 with stochastic rounding (the
    6-bytes-per-parameter recipe).

    Args:
      name: a key of ``OPTIMIZER_RECIPES``.
      inner: the optimizer, e.g. ``optax.adam(1e-3)``.
      **loss_scaled_kwargs: passed to ``jaxamp.loss_scaled`` (``loss_scale``, ``seed``...).

    Returns:
      The ``jaxamp.Policy`` to apply to the model and the optax transformation.

    Examples:
      >>> import optax, jaxamp
      >>> policy, tx = jaxamp.optimizer_recipe("bf16_stochastic", optax.adam(1e-3))
      >>> str(policy)
      'params=bfloat16,compute=bfloat16,output=float32'
    """

    if name not in OPTIMIZER_RECIPES:
        raise invalid_choice("optimizer recipe", name, OPTIMIZER_RECIPES, quote=True)
    policy, master_weights, state_dtype = OPTIMIZER_RECIPES[name]
    if state_dtype is not None:  # its noise is independent of the params' (same seed)
        seed = loss_scaled_kwargs.get("seed", 0)
        inner = with_state_dtype(inner, state_dtype, rounding="stochastic", seed=seed)
    return get_policy(policy), loss_scaled(
        inner, master_weights=master_weights, **loss_scaled_kwargs
    )
