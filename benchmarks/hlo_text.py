"""Reading XLA's compiled HLO text: its computations and their instructions."""

from __future__ import annotations

import re

HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")


def computations(hlo_text: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """Each computation of ``hlo_text`` (``compiled.as_text()``) by name, as its
    instructions ``(name, type, opcode, rest of the line)``, in order.

    Examples:
      >>> hlo = '''ENTRY %main (a: f32[2]) -> f32[2] {
      ...   %a = f32[2]{0} parameter(0)
      ...   ROOT %n = f32[2]{0} negate(%a)
      ... }'''
      >>> [(name, opcode) for name, _, opcode, _ in computations(hlo)["main"]]
      [('a', 'parameter'), ('n', 'negate')]
    """
    found: dict[str, list[tuple[str, str, str, str]]] = {}
    current: list[tuple[str, str, str, str]] | None = None
    for line in hlo_text.splitlines():
        header = HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            current = found.setdefault(header.group(1), [])
            continue
        match = INSTRUCTION.match(line)
        if match and current is not None:
            current.append(match.groups())  # type: ignore[arg-type]
    return found
