"""NNX graph nodes among a function's arguments, split into their state for a pure trace."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
from flax import nnx

from jaxamp._src.autocast import graphs


def is_node(x: Any) -> bool:
    """Whether ``x`` is an NNX graph node that holds state: a module, any other
    ``nnx.Pytree`` (``nnx.Optimizer``, ``nnx.Rngs``), a registered graph-node type or
    an ``nnx.Variable``. A bare ``jax.Ref`` (a graph leaf to NNX) is left to JAX."""
    if isinstance(x, nnx.Variable):
        return True
    return nnx.graph.is_graph_node(x) and not nnx.graph.is_node_leaf(x)


@dataclasses.dataclass(frozen=True)
class _GraphNodes:
    """The NNX graph nodes among the leaves of a pytree, split off so that a trace is pure.

    Attributes:
      treedef: the pytree's structure, with every graph node as one leaf.
      where: the positions of the graph nodes among its leaves.
      nodes: the graph nodes, in that order (the caller's objects).
      graphdef: their joint ``nnx.split`` graph definition; nodes that share
        variables or submodules share them again when merged.
    """

    treedef: Any
    where: frozenset[int]
    nodes: list[Any]
    graphdef: Any

    def merge(self, state: Any, others: list[Any]) -> tuple[Any, list[Any]]:
        """The pytree rebuilt from ``state`` (fresh graph nodes) and the ``others`` leaves.

        Returns:
          ``(tree, merged)``: the pytree and its fresh graph nodes.
        """
        merged = nnx.merge(self.graphdef, state)
        merged_iter, others_iter = iter(merged), iter(others)
        size = len(self.where) + len(others)
        leaves = [next(merged_iter) if i in self.where else next(others_iter) for i in range(size)]
        return jax.tree.unflatten(self.treedef, leaves), merged

    def update(self, new_state: Any) -> None:
        """Writes the variables a call changed (``None``: none did) back into the nodes."""
        if new_state is not None:
            nnx.update(self.nodes, new_state)


def split(tree: Any) -> tuple[_GraphNodes, Any, list[Any]]:
    """Splits the NNX graph nodes of ``tree`` (see ``is_node``) into their state.

    Returns:
      ``(nodes, state, others)``: the ``_GraphNodes``, the state of all the nodes
      (one ``nnx.State``, each variable once) and the other leaves of ``tree``.
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_node)
    where = frozenset(i for i, leaf in enumerate(leaves) if is_node(leaf))
    nodes = [leaves[i] for i in sorted(where)]
    graphdef, state = nnx.split(nodes)
    others = [leaf for i, leaf in enumerate(leaves) if i not in where]
    return _GraphNodes(treedef, where, nodes, graphdef), state, others


def state_values(state: Any) -> dict[Any, tuple[Any, ...]]:
    """``{path: the variable's leaves}`` of an NNX state, taken now (variables mutate)."""
    return {path: tuple(jax.tree.leaves(v)) for path, v in nnx.to_flat_state(state)}


def changed_state(before: dict[Any, tuple[Any, ...]], merged: Any) -> Any:
    """The variables of ``merged`` whose values are not those of ``before`` (by identity:
    an unchanged variable still holds its input tracer), or ``None`` when none changed.
    Only these are written back, so a module whose call mutates nothing is left untouched."""
    changed = []
    for path, variable in nnx.to_flat_state(nnx.state(merged)):
        previous = before.get(path, ())
        leaves = jax.tree.leaves(variable)
        same = len(leaves) == len(previous) and all(
            a is b for a, b in zip(leaves, previous, strict=True)
        )
        if not same:
            changed.append((path, variable))
    return nnx.from_flat_state(changed) if changed else None


# This module is the splitter for NNX graph nodes: autocast's interpreter takes it for a
# call whose arguments hold one, and only then (see jaxamp._src.autocast.graphs).
SPLITTER: graphs.GraphSplitter = sys.modules[__name__]
graphs.register_graph_splitter("nnx", SPLITTER)
