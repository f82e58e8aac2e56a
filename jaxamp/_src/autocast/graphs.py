"""Arguments that hold state in objects (NNX graph nodes), and who splits them for a trace."""

from __future__ import annotations

from typing import Any, Protocol

import jax


class Nodes(Protocol):
    """The graph nodes a ``GraphSplitter`` split off a pytree."""

    def merge(self, state: Any, others: list[Any]) -> tuple[Any, Any]:
        """``(tree, merged)``: the pytree rebuilt from ``state`` and the other leaves, and
        its fresh graph nodes."""
        ...

    def update(self, new_state: Any) -> None:
        """Writes the state a call changed (``None``: none) back into the caller's nodes."""
        ...


class GraphSplitter(Protocol):
    """Splits the graph nodes of a pytree into their state, so that a trace is pure, and
    puts the state a call changed back into them (``jaxamp._src.flax_policy.graph``)."""

    def is_node(self, x: Any) -> bool: ...

    def split(self, tree: Any) -> tuple[Nodes, Any, list[Any]]:
        """``(nodes, state, others)``: the nodes, their state and the other leaves."""
        ...

    def state_values(self, state: Any) -> dict[Any, Any]: ...

    def changed_state(self, before: Any, merged: Any) -> Any: ...


class _Whole:
    def merge(self, state: Any, others: list[Any]) -> tuple[Any, list[Any]]:
        return others[0], []

    def update(self, new_state: Any) -> None:
        pass


class _NoGraph:
    """Arguments without graph nodes: the whole tree is passed as it is."""

    def is_node(self, x: Any) -> bool:
        return False

    def split(self, tree: Any) -> tuple[Nodes, Any, list[Any]]:
        return _Whole(), None, [tree]

    def state_values(self, state: Any) -> dict[Any, Any]:
        return {}

    def changed_state(self, before: Any, merged: Any) -> Any:
        return None


NO_GRAPH: GraphSplitter = _NoGraph()

# The splitters autocast's interpreter may use, by name: a registry, not an argument,
# because jaxamp.autocast takes NNX modules from users, who pass no splitter, and autocast
# depends on JAX alone, so the one for NNX is registered by jaxamp._src.flax_policy.graph.
# Correctness does not depend on import order: each call takes the splitter that knows a
# node among its own arguments, and a call holding none (any function that does not use
# Flax) takes NO_GRAPH whatever is registered, so importing Flax or jaxamp's Flax policies
# changes nothing for it (tests/autocast/context_test.py). A graph node cannot exist
# before Flax is imported, and jaxamp/__init__.py, which runs before any module of
# jaxamp._src can be used, imports jaxamp.nnx, which registers NNX's. Registering is
# idempotent, and the entries are consulted by name, never in the order they came.
_SPLITTERS: dict[str, GraphSplitter] = {}


def register_graph_splitter(name: str, splitter: GraphSplitter) -> None:
    """Lets ``jaxamp.autocast`` split the graph nodes ``splitter`` knows (see above)."""
    _SPLITTERS[name] = splitter


def splitter_for(tree: Any) -> GraphSplitter:
    """The registered splitter that knows a graph node among ``tree``'s leaves, or
    ``NO_GRAPH``."""
    for name in sorted(_SPLITTERS):
        splitter = _SPLITTERS[name]
        if any(map(splitter.is_node, jax.tree.leaves(tree, is_leaf=splitter.is_node))):
            return splitter
    return NO_GRAPH
