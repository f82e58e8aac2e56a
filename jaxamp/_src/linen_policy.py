"""Applying a policy to an unmodified Flax Linen model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn

from jaxamp._src import layers
from jaxamp._src.backend import auto_policy
from jaxamp._src.policy import Policy, cast_floating, get_policy
from jaxamp._src.residuals import checkpoint_residuals, validate_residuals

# Keyword arguments of ``Module.init``/``Module.apply`` that are not model inputs.
_APPLY_KWARGS = frozenset({"rngs", "method", "mutable", "capture_intermediates"})


@contextlib.contextmanager
def _temporarily_set(module: nn.Module, attributes: tuple[tuple[str, Any], ...]) -> Iterator[None]:
    """Sets attributes of a (frozen) module for the duration of one method call."""
    saved = [(name, getattr(module, name)) for name, _ in attributes]
    try:
        for name, value in attributes:
            object.__setattr__(module, name, value)
        yield
    finally:
        for name, value in reversed(saved):
            object.__setattr__(module, name, value)


def _module_chain(module: nn.Module) -> Iterator[tuple[tuple[str, ...], nn.Module]]:
    """``(path, module)`` from ``module`` up to the root, for bound modules."""
    while isinstance(module, nn.Module):
        scope = module.scope
        yield (tuple(scope.path) if scope is not None else ()), module
        module = module.parent


class PolicyModule:
    """A Linen module with a precision policy, with the module's ``init``/``apply`` contract.

    Made by :func:`jaxamp.linen.apply_policy`. ``init`` and ``apply`` take the same
    arguments as the wrapped module's and return variables of the same structure,
    so checkpoints, ``TrainState.create(apply_fn=model.apply, ...)`` and
    ``method=`` keep working. Any other attribute is looked up on the wrapped module.

    Attributes:
      module: the unmodified Linen module.
      policy: the policy applied to it.
      overrides: ``(key, Policy)`` pairs, as given to ``apply_policy``.
      residuals: what the backward pass may save (see ``apply_policy``).
    """

    def __init__(
        self,
        module: nn.Module,
        policy: Policy,
        overrides: tuple[tuple[Any, Policy], ...] = (),
        residuals: str = "compute_dtype",
    ):
        self.module = module
        self.policy = policy
        self.overrides = overrides
        self.residuals = residuals

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("module", "policy", "overrides", "residuals"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"PolicyModule({type(self.module).__name__}, policy='{self.policy}')"

    def _interceptor(self, next_fun, args, kwargs, context):
        module = context.module
        policy = layers.resolve_policy(self.policy, self.overrides, _module_chain(module))
        plan = layers.plan_layer(module, policy, context.method_name)
        if not plan:
            return next_fun(*args, **kwargs)
        with _temporarily_set(module, plan.attributes):
            if plan.matmul is not None:
                out = layers.run_unhooked(module, plan, *args, **kwargs)
            else:
                out = next_fun(*args, **kwargs)
        if plan.cast_output_to is not None:
            out = cast_floating(out, plan.cast_output_to)
        return out

    def _cast_inputs(self, args, kwargs):
        args = self.policy.cast_to_compute(args)
        kwargs = {
            k: v if k in _APPLY_KWARGS else self.policy.cast_to_compute(v)
            for k, v in kwargs.items()
        }
        return args, kwargs

    def _returns_state(self, kwargs) -> bool:
        return bool(kwargs.get("mutable", False)) or bool(
            kwargs.get("capture_intermediates", False)
        )

    def init_with_output(self, rngs, *args, **kwargs):
        """Like ``nn.Module.init_with_output``; params are created in ``param_dtype``."""
        args, kwargs = self._cast_inputs(args, kwargs)
        with nn.intercept_methods(self._interceptor):
            out, variables = self.module.init_with_output(rngs, *args, **kwargs)
        return self.policy.cast_to_output(out), variables

    def init(self, rngs, *args, **kwargs):
        """Like ``nn.Module.init``; params are created in ``param_dtype``."""
        args, kwargs = self._cast_inputs(args, kwargs)
        with nn.intercept_methods(self._interceptor):
            return self.module.init(rngs, *args, **kwargs)

    def apply(self, variables, *args, **kwargs):
        """Like ``nn.Module.apply``, with the policy; outputs come back in ``output_dtype``.

        Floating inputs are cast to the compute dtype (integer inputs such as token
        ids are left alone), the ``params`` collection to the param dtype, and the
        output (not the updated mutable collections) to the output dtype.
        """
        args, kwargs = self._cast_inputs(args, kwargs)
        if isinstance(variables, Mapping) and "params" in variables:
            variables = {**variables, "params": self.policy.cast_to_param(variables["params"])}

        def run(variables, args, kwargs):
            with nn.intercept_methods(self._interceptor):
                return self.module.apply(variables, *args, **kwargs)

        if self.policy.compute_dtype.itemsize < 4:
            run = checkpoint_residuals(run, self.residuals)
        out = run(variables, args, kwargs)
        if self._returns_state(kwargs):
            y, state = out
            return self.policy.cast_to_output(y), state
        return self.policy.cast_to_output(out)


def apply_policy(
    module: nn.Module,
    policy: str | Policy | None = None,
    *,
    overrides: Mapping[Any, Any] | None = None,
    residuals: str = "compute_dtype",
) -> PolicyModule:
    """Runs an unmodified Linen module under a precision policy.

    Every layer that follows Flax's conventions (``Dense``, ``DenseGeneral``,
    ``Einsum``, ``Conv``, ``ConvTranspose``, ``Embed``, the attention and
    normalisation layers, and your own modules that have ``dtype``/``param_dtype``
    fields) runs with ``dtype=compute_dtype`` and creates its params in
    ``param_dtype``; matmuls and convolutions run under jaxamp's 16-bit matmul rule
    (16-bit operands, float32 accumulation, forward and backward, float32 weight
    gradients; see ``jaxamp/_src/matmul.py``), attention's softmax and normalisation
    statistics are computed in float32, ``batch_stats`` stay float32. Arithmetic
    a custom module writes itself (``x @ self.param(...)``) follows JAX's type
    promotion; :func:`jaxamp.autocast` covers such code.

    The policy is applied while the returned object's ``init``/``apply`` trace
    the module, so the module's code and its variables' structure are unchanged.

    Args:
      module: a Linen module.
      policy: a :class:`jaxamp.Policy` or a spec for :func:`jaxamp.get_policy`;
        ``None`` picks :func:`jaxamp.auto_policy`.
      overrides: per-class or per-path policies, e.g. ``{"head": "float32"}`` or
        ``{nn.Dense: "float32"}``. A class key covers its instances and all
        modules inside them; a string is a glob pattern matched against module
        paths (``"head"``, ``"Dense_*"``, ``"encoder/*/attention"``), at the end
        of the path, covering the subtree below a match. The closest match wins.
      residuals: what the backward pass may keep under a 16-bit compute dtype:
        ``"compute_dtype"`` (default; float32 temporaries such as normalisation
        and softmax intermediates are recomputed from 16-bit values),
        ``"dots"`` (only matmul, convolution and reduction outputs are kept) or
        ``"all"`` (JAX's default). See :func:`jaxamp.checkpoint_residuals`.

    Returns:
      A :class:`PolicyModule` with ``init``, ``init_with_output`` and ``apply``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxamp
      >>> model = jaxamp.linen.apply_policy(nn.Dense(3), "mixed_bfloat16")
      >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
      >>> variables["params"]["kernel"].dtype, model.apply(variables, jnp.ones((2, 4))).dtype
      (dtype('float32'), dtype('float32'))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"apply_policy expects a flax.linen.Module, got {type(module).__name__}. "
            "For flax.nnx modules use jaxamp.nnx.apply_policy."
        )
    if policy is None:
        policy = auto_policy()
    return PolicyModule(
        module,
        get_policy(policy),
        layers.normalize_overrides(overrides),
        validate_residuals(residuals),
    )
