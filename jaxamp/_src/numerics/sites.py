"""Where a primitive runs, as the numerics tools are told it: its ``Site``, and the
visitors and taggers an evaluation calls with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxamp._src.audit.checks import short_name

LOSS_SCALE_SCOPE = "jaxamp_loss_scale"  # the multiplication of the loss by the loss scale


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a primitive runs.

    Attributes:
      primitive: the JAX primitive (``"log"``, ``"dot_general"``...).
      phase: ``"forward"`` or ``"backward"`` (the gradient's computation).
      layer: the module path, e.g. ``"Model/Dense_0"``; ``""`` outside any layer.
      source: ``file:line (function)`` of the user code that traced it.
      name_stack: the name stack JAX recorded, in full.
      iteration: the loop iterations it runs in (outermost first), ``()`` outside loops.
      sixteen_bit: per output, whether the program holds it in a 16-bit type (when
        evaluated widened, the value seen is its float32 counterpart).
      eqn: the equation itself (for ``in_float32``).

    Inside a ``shard_map``'s body, the inputs and outputs a visitor is handed are the
    shards' values, stacked along one leading axis per manual mesh axis (in the mesh's
    order).
    """

    primitive: str
    phase: str
    layer: str
    source: str
    name_stack: str
    iteration: tuple[int, ...] = ()
    sixteen_bit: tuple[bool, ...] = ()
    eqn: Any = dataclasses.field(default=None, repr=False, compare=False)


Visitor = Callable[[Site, Sequence[Any], Sequence[Any]], bool | None]


class Tagger(Protocol):
    """Follows values through an evaluation: each value carries a tag, which the tagger
    computes for every primitive's outputs from its inputs' tags.

    Attributes:
      constant: the tag of a literal or a constant of the program (the arguments'
        tag is ``None``).
    """

    constant: Any

    def op(
        self, site: Site, tags: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any]
    ) -> tuple[list[Any], bool]:
        """The outputs' tags, and whether to stop the evaluation."""
        ...

    def merge(self, tags: Sequence[Any]) -> Any:
        """The tag of a scan's stacked output, from its iterations' (``[]``: none ran)."""
        ...


def layer(stack: str, primitive: str) -> str:
    """The layer path of a name stack. A module that evaluates its call again inside its
    own scope (``jaxamp.nnx``'s policy interprets the call it traced) repeats its name;
    the repeats are one layer. ``jnp.einsum``'s scope (its spec) belongs to the layer
    that calls it."""
    # jnp.einsum names a scope after its spec ("...qhd,...khd->...hqk"): not a layer
    parts = short_name(f"f/{stack}/{primitive}").split("/")
    parts = [p for p in parts if "->" not in p and p != LOSS_SCALE_SCOPE]
    return "/".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])
