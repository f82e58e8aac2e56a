"""What composes with ``jaxamp.loss_scaled``: the generated compositions, counted.

    python -m benchmarks.compositions [--examples 400] [--seed 0] [--out DIR]

Runs the strategy of ``tests/optim/generated_compositions_test.py`` (optax chains,
``named_chain``, ``multi_transform``, ``masked``, ``MultiSteps``, ``apply_if_finite``,
``inject_hyperparams``, ``lookahead``, clipping, weight decay, ``scale``,
``apply_every``, ``with_state_dtype``, ``contrib.sam``, ``contrib.prodigy`` and
``lbfgs``, with ``loss_scaled`` at every position, float32, bfloat16 and float16
params, every master-weights recipe and injected overflows) and checks each example
against the float32 reference. It writes ``compositions.md`` and ``.json``: for each
piece, how many examples had it inside ``loss_scaled`` (and tracked the reference)
and how many had it around ``loss_scaled`` (and were refused). Any example outside
"tracks" or "refused" stops the run with hypothesis's smallest failing case.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from tqdm import tqdm

from benchmarks.common import environment, markdown_table, write_results
from tests.optim.generated_compositions_test import BASES, WRAPPERS, Case, cases, check


def run(examples: int, seed: int, shrink: bool = True) -> list[Case]:
    """The examples tried, each checked (an exception stops the run)."""
    tried: list[Case] = []
    bar = tqdm(total=examples, desc="compositions", unit="example")

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
        phases=list(Phase) if shrink else [Phase.generate],
    )
    @given(cases())
    def one(case):
        check(case)
        tried.append(case)
        bar.update(1)

    one._hypothesis_internal_use_seed = seed  # reproducible draws
    one()
    bar.close()
    return tried


def tabulate(tried: list[Case]) -> list[dict[str, Any]]:
    """Per piece: the examples with it inside loss_scaled (all tracked) and around it
    (all refused, unless the piece passes everything through)."""
    inside: collections.Counter = collections.Counter()
    around: collections.Counter = collections.Counter()
    refused: collections.Counter = collections.Counter()
    for case in tried:
        pieces = [case.base, *case.wrappers[: case.position]]
        for piece in set(pieces):
            inside[piece] += not case.refused
        for piece in set(case.wrappers[case.position :]):
            around[piece] += 1
            refused[piece] += case.refused
    rows = []
    for piece in list(BASES) + list(WRAPPERS):
        rows.append(
            {
                "piece": piece,
                "inside": inside[piece],
                "around": around[piece],
                "around_refused": refused[piece],
                "composes_around": (
                    "-"
                    if piece in BASES
                    else "yes (passes everything through)"
                    if WRAPPERS[piece]
                    else "no: refused, naming loss_scaled(...) outermost"
                ),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument(
        "--no-shrink", action="store_true", help="report the first failing example as drawn"
    )
    args = parser.parse_args()
    env = environment()
    start = time.perf_counter()
    tried = run(args.examples, args.seed, shrink=not args.no_shrink)
    seconds = time.perf_counter() - start
    rows = tabulate(tried)
    tracked = sum(not c.refused for c in tried)
    by_dtype = collections.Counter(c.dtype for c in tried if not c.refused)
    header = (
        f"# What composes with loss_scaled\n\n{len(tried)} generated compositions "
        f"(seed {args.seed}, {seconds:.0f} s), cpu ({env['cpu_model']}; bf16 flags: "
        f"{', '.join(env['cpu_bf16_flags']) or 'none'}): {tracked} tracked the float32 "
        f"reference ({', '.join(f'{n} {d}' for d, n in sorted(by_dtype.items()))} params), "
        f"{len(tried) - tracked} were refused, none was outside the two.\n\n"
        "'inside: tracked': examples with the piece inside loss_scaled and nothing but "
        "pass-through wrappers around it, all of which tracked the reference. "
        "'around': examples with the piece around loss_scaled; 'refused': how many of "
        "those were refused.\n"
    )
    table = markdown_table(
        rows,
        [
            ("piece", "piece"),
            ("inside", "inside: tracked"),
            ("around", "around"),
            ("around_refused", "around: refused"),
            ("composes_around", "around loss_scaled"),
        ],
    )
    records = [
        {"seconds": seconds, "examples": len(tried), "tracked": tracked},
        *rows,
    ]
    out = write_results(args.out, "compositions", records, header + "\n" + table, env)
    print(header + "\n" + table)
    print(f"wrote {out}/compositions.md")


if __name__ == "__main__":
    main()
