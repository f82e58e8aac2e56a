"""Walking a lowered program: every operation, its full layer name and how often it runs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

# The module is read as the MLIR Python objects ``Lowered.compiler_ir("stablehlo")`` returns,
# through their documented attributes (``name``, ``regions``, ``operands``, ``results``,
# ``location``), not as text: nothing here is JAX-private.
_LOC_NAME = re.compile(r'loc\("([^"]*)"')
_DENSE_INT = re.compile(r"dense<(-?\d+)>")
_TENSOR = re.compile(r"tensor<([^>]*)>")


@dataclasses.dataclass(frozen=True)
class WalkedOp:
    """One operation of the program, with what the walk learnt about it.

    Attributes:
      operation: the MLIR operation (``operation.name`` is e.g. ``"stablehlo.exponential"``).
      name: its full layer name (``jit(step)/transpose(jvp(Model))/Dense_0/exp``).
      executions: how many times it runs per call of the program, or ``None``
        when it sits in a loop whose trip count the program does not state.
      key: identifies the operation in the program text (function, position), so
        that an operation reached from several call sites is one operation.
    """

    operation: Any
    name: str
    executions: int | None
    key: tuple[str, int]


def location_name(operation: Any) -> str:
    """The name JAX gave an operation's location (``""`` when it has none)."""
    match = _LOC_NAME.search(str(operation.location))
    return match.group(1) if match else ""


def tensor_type(value: Any) -> tuple[tuple[int, ...], str]:
    """``(shape, element type)`` of an MLIR value: ``tensor<4x3xbf16>`` -> ``((4, 3), 'bf16')``."""
    match = _TENSOR.search(str(value.type))
    if not match:
        return (), str(value.type)
    parts = match.group(1).split("x")
    return tuple(int(p) for p in parts[:-1] if p.isdigit()), parts[-1]


def _join(prefix: str, name: str) -> str:
    if not prefix or name.startswith("jit("):
        return name
    return f"{prefix}/{name}" if name else prefix


def _multiply(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a * b


def _defining(value: Any) -> Any:
    """The operation that defines ``value`` (``None`` for a block argument)."""
    return getattr(getattr(value, "owner", None), "operation", None)


def _constant(value: Any) -> int | None:
    """The integer a value holds if a ``stablehlo.constant`` defines it."""
    operation = _defining(value)
    if operation is None or operation.name != "stablehlo.constant":
        return None
    match = _DENSE_INT.search(str(operation.attributes["value"]))
    return int(match.group(1)) if match else None


def _returned(block: Any) -> list[Any]:
    """The values a region's block returns (its terminator's operands)."""
    *_, terminator = block.operations
    return list(terminator.operation.operands)


def _loop_constant(while_op: Any, value: Any) -> int | None:
    """The integer ``value`` holds in the loop's condition: a constant, or a loop operand
    initialised by a constant that the body passes on unchanged."""
    known = _constant(value)
    if known is not None:
        return known
    cond, body = (region.blocks[0] for region in while_op.regions)
    arguments = list(cond.arguments)
    if value not in arguments:
        return None
    index = arguments.index(value)
    if _returned(body)[index] != list(body.arguments)[index]:
        return None
    return _constant(while_op.operands[index])


def _step(while_op: Any, index: int) -> int | None:
    """The constant the loop body adds to loop operand ``index``, else ``None``."""
    body = while_op.regions[1].blocks[0]
    update = _defining(_returned(body)[index])
    if update is None or update.name != "stablehlo.add":
        return None
    counter = list(body.arguments)[index]
    lhs, rhs = update.operands
    if lhs == counter:
        return _constant(rhs)
    return _constant(lhs) if rhs == counter else None


def _counter_and_bound(cond: Any) -> tuple[Any, Any] | None:
    """``(counter, bound)`` when the condition returns ``counter < bound`` itself (not
    combined with another predicate), else ``None``."""
    compare = _defining(_returned(cond)[0])
    if compare is None or compare.name != "stablehlo.compare":
        return None
    lhs, rhs = compare.operands
    direction = str(compare.attributes["comparison_direction"]).rstrip(">").split()[-1]
    return {"LT": (lhs, rhs), "GT": (rhs, lhs)}.get(direction)


def trip_count(while_op: Any) -> int | None:
    """The number of iterations of a ``stablehlo.while`` written as a counted loop.

    The condition returns ``compare LT, %counter, %bound`` (or ``GT, %bound,
    %counter``) and nothing else, the bound is a constant (or a loop operand
    initialised by one that the body passes on unchanged, as ``fori_loop`` with
    array bounds carries it), the counter is a loop operand initialised by a
    constant, and the body's update of it adds a positive constant ``step``: the
    loop runs ``ceil((bound - start) / step)`` times (``0`` if the bound is not
    above the start). Else ``None``.

    Args:
      while_op: a ``stablehlo.while`` operation.

    Returns:
      The trip count, or ``None`` when the program does not state it.
    """
    cond = while_op.regions[0].blocks[0]
    found = _counter_and_bound(cond)
    arguments = list(cond.arguments)
    if found is None or found[0] not in arguments:
        return None
    counter, bound = found
    index = arguments.index(counter)
    lo = _constant(while_op.operands[index])
    hi = _loop_constant(while_op, bound)
    step = _step(while_op, index)
    if lo is None or hi is None or step is None or step <= 0:
        return None
    return max(-((lo - hi) // step), 0)


def walk(module: Any) -> list[WalkedOp]:
    """Every operation reachable from ``main``, merged per program position.

    An operation reached from several call sites appears once, with the sum of
    its executions (``None`` if any site's is unknown) and the name from its
    first call site.
    """
    functions = {}
    for operation in module.body.operations:
        operation = operation.operation
        if operation.name == "func.func":
            functions[str(operation.attributes["sym_name"]).strip('"')] = operation
    merged: dict[tuple[str, int], WalkedOp] = {}
    order: list[tuple[str, int]] = []
    entry = "main" if "main" in functions else next(iter(functions), None)
    if entry is None:
        return []
    for op in _walk_function(functions, entry, "", 1, ()):
        previous = merged.get(op.key)
        if previous is None:
            merged[op.key] = op
            order.append(op.key)
        else:
            total = (
                None
                if previous.executions is None or op.executions is None
                else previous.executions + op.executions
            )
            merged[op.key] = dataclasses.replace(previous, executions=total)
    return [merged[k] for k in order]


def _walk_function(
    functions: dict[str, Any], name: str, prefix: str, times: int | None, stack: tuple[str, ...]
) -> Iterator[WalkedOp]:
    if name in stack or name not in functions:  # recursion cannot come from JAX; be safe
        return
    counter = iter(range(1 << 62))
    for block in functions[name].regions[0].blocks:
        yield from _walk_block(functions, block, name, prefix, times, (*stack, name), counter)


def _walk_block(
    functions: dict[str, Any],
    block: Any,
    function: str,
    prefix: str,
    times: int | None,
    stack: tuple[str, ...],
    counter: Iterator[int],
) -> Iterator[WalkedOp]:
    for inner in block.operations:
        operation = inner.operation
        index = next(counter)
        full_name = _join(prefix, location_name(operation))
        yield WalkedOp(operation, full_name, times, (function, index))
        if operation.name == "func.call":
            callee = str(operation.attributes["callee"]).lstrip("@").strip('"')
            yield from _walk_function(functions, callee, full_name, times, stack)
        elif operation.name == "stablehlo.while":
            cond, body = operation.regions
            yield from _walk_region(functions, cond, function, prefix, times, stack, counter)
            inner_times = _multiply(times, trip_count(operation))
            yield from _walk_region(functions, body, function, prefix, inner_times, stack, counter)
        else:
            for region in operation.regions:
                yield from _walk_region(functions, region, function, prefix, times, stack, counter)


def _walk_region(
    functions: dict[str, Any],
    region: Any,
    function: str,
    prefix: str,
    times: int | None,
    stack: tuple[str, ...],
    counter: Iterator[int],
) -> Iterator[WalkedOp]:
    for block in region.blocks:
        yield from _walk_block(functions, block, function, prefix, times, stack, counter)
