"""What ``suggest_policy`` measures: a loss over a Linen model, an NNX model or any
function, run as written (the float32 reference) and under a candidate policy."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import nnx

from jaxamp._src.autocast.api import autocast
from jaxamp._src.flax_policy import linen as linen_policy
from jaxamp._src.flax_policy import nnx as nnx_policy
from jaxamp._src.policy import Policy, PolicyLike

Run = tuple[Callable[..., Any], tuple[Any, ...]]
"""A loss and the arguments to call it with."""


def _layers(overrides: dict[str, str]) -> dict[str | type, PolicyLike]:
    """``overrides`` as the policies' ``apply_policy`` takes them."""
    return {key: policy for key, policy in overrides.items()}


class Target:
    """A loss of any function: its candidates run under ``jaxamp.autocast``."""

    def __init__(self, loss: Callable[..., Any], args: tuple[Any, ...]):
        self.loss, self.args = loss, args

    def reference(self) -> Run:
        """The loss as written, in float32."""
        return self.loss, self.args

    def mixed(self, policy: Policy, overrides: dict[str, str]) -> Run:
        """The loss under ``policy`` with ``overrides``."""
        return autocast(self.loss, policy, overrides=overrides or None), self.args


class LinenTarget(Target):
    """``loss(model, *args)`` of a Linen model: its candidates run under
    ``jaxamp.linen.apply_policy``."""

    def __init__(self, loss: Callable[..., Any], args: tuple[Any, ...], model: nn.Module):
        super().__init__(loss, args)
        self.model = model

    def reference(self) -> Run:
        return functools.partial(self.loss, self.model), self.args

    def mixed(self, policy: Policy, overrides: dict[str, str]) -> Run:
        wrapped = linen_policy.apply_policy(self.model, policy, overrides=_layers(overrides))
        return functools.partial(self.loss, wrapped), self.args


class NnxTarget(Target):
    """``loss(model, *rest)`` of an NNX model: each candidate runs on a copy of the model
    under ``jaxamp.nnx.apply_policy`` (the model itself is left as it is)."""

    def mixed(self, policy: Policy, overrides: dict[str, str]) -> Run:
        copy = nnx_policy.apply_policy(
            nnx.clone(self.args[0]), policy, overrides=_layers(overrides)
        )
        return self.loss, (copy, *self.args[1:])


def make(loss: Callable[..., Any], args: tuple[Any, ...], model: Any) -> Target:
    """The target for ``suggest_policy``'s arguments."""
    if not callable(loss):
        raise TypeError(f"suggest_policy expects a loss function, got {type(loss).__name__}.")
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                "model= takes a flax.linen.Module (the loss is then loss(model, *args)), got "
                f"{type(model).__name__}. Pass an NNX model as the loss's first argument "
                "instead, and a plain function with no model."
            )
        return LinenTarget(loss, args, model)
    if not args:
        raise TypeError("suggest_policy needs the loss's arguments: suggest_policy(loss, *args).")
    if isinstance(args[0], nnx.Module):
        return NnxTarget(loss, args)
    return Target(loss, args)


def apply(target: Any, policy: Policy, overrides: dict[str, str]) -> Any:
    """``target`` under ``policy`` and ``overrides``, by its kind."""
    if isinstance(target, nn.Module):
        return linen_policy.apply_policy(target, policy, overrides=_layers(overrides))
    if isinstance(target, nnx.Module):
        return nnx_policy.apply_policy(target, policy, overrides=_layers(overrides))
    if callable(target):
        return autocast(target, policy, overrides=overrides or None)
    raise TypeError(
        f"apply takes a Linen module, an NNX module or a function, got {type(target).__name__}."
    )
