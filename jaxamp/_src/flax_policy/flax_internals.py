"""The Flax internals the policy relies on, fenced in one place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
from flax.core.scope import LazyRng

# --- Flax internals, in one place -----------------------------------------------------------
# Linen gives a wrapper no public way to do what the policy needs, so the few places that
# reach past Flax's public API are here, each read from flax 0.12.x, each covered by the
# Linen policy's tests (tests/flax_policy):
# - a Module is a frozen dataclass: a layer's dtype settings are set for one call with
#   ``object.__setattr__`` (``temporarily_set``);
# - ``Module._try_setup`` runs ``setup`` of a bound module that has not run it yet
#   (``run_setup``);
# - ``nn.share_scope`` is public, but its two defects are worked around with a Scope's
#   ``parent``, ``path``, ``debug_path``, ``rngs``, ``reserve``, ``flax.core.scope.LazyRng``
#   and ``Module._state.children`` (``share_scope``);
# - ``nn.scan`` names the class it makes ``Scan<Body>`` (``is_scan_body``);
# - ``nn.Einsum._get_bias_shape`` is the bias shape of an einsum (``einsum_bias_shape``).
# The lifted call itself goes through Flax's public ``flax.core.lift.pack`` and
# ``nn.transforms.lift_direct_transform`` (jaxamp._src.flax_policy.linen).


@contextlib.contextmanager
def temporarily_set(module: nn.Module, attributes: tuple[tuple[str, Any], ...]) -> Iterator[None]:
    """Sets attributes of a (frozen) module for the duration of one method call."""
    saved = [(name, getattr(module, name)) for name, _ in attributes]
    try:
        for name, value in attributes:
            object.__setattr__(module, name, value)
        yield
    finally:
        for name, value in reversed(saved):
            object.__setattr__(module, name, value)


def is_scan_body(owner: nn.Module, module: nn.Module) -> bool:
    """Whether ``module`` is the body of ``owner``, a module class ``nn.scan`` made (Flax
    names it ``Scan<Body>`` and calls a clone of the body inside the scan), or the body
    another lifted class wraps there (``nn.scan(nn.remat(Cell))``: ``ScanCheckpointCell``
    calls ``CheckpointCell``, which calls ``Cell``)."""
    cls, body = type(owner), type(module)
    return (
        cls.__name__.startswith("Scan")
        and cls.__name__.endswith(body.__name__)
        and body is not cls
        and issubclass(cls, body)
    )


def share_scope(policy_module: nn.Module, module: nn.Module) -> None:
    """Makes ``policy_module`` and ``module``, the module it wraps, share one scope, so that the
    variables sit where the module alone's would, as Flax's ``share_scope`` does, with two
    defects of it worked around. It picks which of the two moves by whether one scope is
    the other's child; but a module the policy module bound itself (a field, in a scope
    named ``module`` below it) is not its scope's child under a Flax transformation that
    lifts a parent, so the policy module moved and the variables sat under an extra
    ``module`` level. And it keeps the path and RNGs of the children it moves (submodules
    held as dataclass fields) derived from the scope they left, so they drew other
    initial values. A module bound elsewhere (made in a parent's compact method, with
    its own name) keeps its scope, and the policy module takes it, as in Flax."""
    scope = policy_module.scope
    assert scope is not None  # setup runs bound
    old = module.scope
    if old is None or (old.parent is not scope and old.path != (*scope.path, "module")):
        nn.share_scope(policy_module, module)
        return
    object.__setattr__(module, "scope", scope)
    for child in module._state.children.values():
        if not isinstance(child, nn.Module):
            continue
        inner = getattr(child, "scope", None)
        if inner is None or inner.parent is not old:
            continue
        if isinstance(inner.name, str):
            scope.reserve(inner.name)
        inner.parent = scope
        _rederive(child, inner)


def _rederive(module: nn.Module, scope: Any) -> None:
    """``scope`` (``module``'s, just moved) and those of its children already bound with
    the path and RNGs ``Scope.push`` would have given them under their parent."""
    if not isinstance(scope.name, str):
        return
    parent = scope.parent
    scope.path = (*parent.path, scope.name)
    scope.debug_path = (*parent.debug_path, scope.name)
    scope.rngs = {key: LazyRng.create(rng, scope.name) for key, rng in parent.rngs.items()}
    for child in module._state.children.values():
        if not isinstance(child, nn.Module):
            continue
        inner = getattr(child, "scope", None)
        if inner is not None and inner.parent is scope:
            _rederive(child, inner)


def run_setup(module: nn.Module) -> None:
    """Runs ``module``'s ``setup`` if it has not run (Flax runs it lazily, on first access)."""
    module._try_setup()


def einsum_bias_shape(module: nn.Einsum, einsum_str: str, inputs: Any, kernel: Any) -> Any:
    """``(bias_shape, broadcast_shape)`` of ``nn.Einsum``'s bias, as Flax computes them."""
    return module._get_bias_shape(einsum_str, inputs, kernel)
