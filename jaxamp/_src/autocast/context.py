"""What one call of an autocast function gives every evaluation inside it, passed down."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxamp._src.autocast import constants, fp8_state
from jaxamp._src.autocast.rules import AutocastConfig
from jaxamp._src.autocast.weights import Weights


class KeptWide:
    """Whether an evaluation kept a value wider than traced (a constant evaluated with its
    written value, a weakly typed value too large for 16 bits), so that the value keeps
    its width where the program returns it. A flag made by ``watch`` tells its parent too."""

    def __init__(self, parent: KeptWide | None = None):
        self.noted = False
        self._parent = parent

    def note(self) -> None:
        """Records that a value was kept wider than traced, here and in every parent."""
        flag: KeptWide | None = self
        while flag is not None:
            flag.noted = True
            flag = flag._parent

    def watch(self) -> KeptWide:
        """A fresh flag whose notes reach this one too (an abstract evaluation of a loop's
        body, asking whether it widens the carry)."""
        return KeptWide(self)


@dataclasses.dataclass(frozen=True)
class CallContext:
    """Everything an evaluation reads besides its program and its values, made by the call
    (``jaxamp._src.autocast.api``) and handed down by the interpreter: each ``Env`` holds
    one, and every nested evaluation (a call, a loop's body, a custom rule) takes its
    ``Env``'s. Nothing is read from a global, so calls in other threads, and calls nested
    in one another, never see each other's.

    Attributes:
      config: the policy and the rule table.
      written: ``id(literal): float32 value`` for the constants a 16-bit trace rounded to
        ``inf``, evaluated with the value the program wrote (``constants.written_values``).
      program: the jaxpr those literals belong to, held so that their ids stay theirs.
      fp8: the call's FP8 state, for delayed scaling (``None``: current scaling).
      kept: whether a value was kept wider than traced (see ``KeptWide``).
      float32_eqns: the ids of the equations of ``program`` an override keeps in float32
        (``jaxprs.eqns_in_scopes`` of ``config.float32_scopes``).
      weights: which GEMMs are against a weight, under a float8 or block format (``None``
        without one): see ``weights.Weights``.
    """

    config: AutocastConfig
    written: Mapping[int, Any] = dataclasses.field(default_factory=dict)
    program: Any = None
    fp8: fp8_state.Store | None = None
    kept: KeptWide = dataclasses.field(default_factory=KeptWide)
    float32_eqns: frozenset[int] = frozenset()
    weights: Weights | None = None

    def with_config(self, config: AutocastConfig) -> CallContext:
        """This context with another policy or rule table (a custom rule's inside, a
        matmul traced in 16 bits)."""
        return dataclasses.replace(self, config=config)

    def enter(self, outer: Sequence[Any], inner: Sequence[Any], sources: Sequence[Any]) -> None:
        """A body's arguments ``inner``, entered with the values ``outer`` (moved or cast
        from ``sources``), keep their names (delayed scaling's state) and their kinds
        (weights, activations or tables)."""
        fp8_state.rename(self.fp8, outer, inner)
        if self.weights is not None:
            self.weights.enter(outer, inner, sources)

    def watching(self) -> CallContext:
        """This context with a fresh ``kept`` flag that reports to this one's."""
        return dataclasses.replace(self, kept=self.kept.watch())

    def written_value(self, atom: Any) -> Any:
        """The value the program wrote for the literal ``atom``, or ``None`` (as traced)."""
        return self.written.get(id(atom)) if self.written else None

    def may_keep_wide(self, jaxpr: Any) -> bool:
        """Whether evaluating ``jaxpr`` may keep a value wider than traced (see
        ``constants.may_keep_wide``)."""
        return constants.may_keep_wide(jaxpr, self.written)
