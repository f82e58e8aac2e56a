"""The FP8 training benchmark's digits run over several seeds, judged on the seeds' mean.

    python -m benchmarks.fp8_training_seeds [--seeds 3,4,5,6,7] [--out DIR]

One seed of digits cannot separate the formats: its 360 test images give held-out
accuracy a standard error of about 0.9 points, against a tolerance of 1.5
(``fp8_training.ACCURACY_TOLERANCE``), and each single-seed run flipped the verdict on
some variant, float32's own included. The rule, fixed before the seeds it is judged on
were run (``RULE``): a variant follows bf16 when its held-out accuracy averaged over the
seeds is within ``ACCURACY_TOLERANCE`` of bf16's average, and no step of any seed was
non-finite. The default seeds, 3 to 7, are ones no earlier run used (0 to 2 were).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import fp8_training
from benchmarks.common import markdown_table
from jaxamp._src.backend import cpu_info

RULE = (
    "a variant follows bf16 when its held-out accuracy averaged over the seeds is within "
    f"{fp8_training.ACCURACY_TOLERANCE:g} of bf16's average and no step of any seed was "
    "non-finite"
)
VARIANTS = "fp32,bf16,fp8,mxfp8,nvfp4"


def aggregate(per_seed: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: each seed's held-out accuracy, their mean, the gap of the
    mean to bf16's, and the verdict by ``RULE``."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for result in per_seed.values():
        (model,) = result["models"]
        for r in model["runs"]:
            runs.setdefault(r["variant"], []).append(r)
    bf16 = statistics.mean(r["held_out_accuracy"] for r in runs["bf16"])
    rows = []
    for variant, rs in runs.items():
        accuracies = [r["held_out_accuracy"] for r in rs]
        mean = statistics.mean(accuracies)
        row: dict[str, Any] = {
            "variant": variant,
            "accuracies": accuracies,
            "mean_accuracy": mean,
            "sd": statistics.stdev(accuracies) if len(rs) > 1 else 0.0,
            "gap_to_bf16_points": 100 * (mean - bf16),
            "nonfinite_steps": sum(r["nonfinite_steps"] for r in rs),
        }
        if variant in fp8_training.TOLERANCES:
            row["follows_bf16"] = bool(
                abs(mean - bf16) <= fp8_training.ACCURACY_TOLERANCE and not row["nonfinite_steps"]
            )
        rows.append(row)
    return rows


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="3,4,5,6,7", help="comma-separated seeds")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--steps", type=int, default=fp8_training.Sizes().steps)
    parser.add_argument("--tag", default=None, help="file name tag (default: from the CPU)")
    parser.add_argument("--out", default=None, help="folder for the .json and .md")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, not {args.seeds!r}")
    if len(seeds) < 2:
        parser.error(f"--seeds needs two seeds or more to judge on their mean, not {seeds}")
    if "bf16" not in args.variants.split(","):
        parser.error(f"--variants must include bf16, the reference: {args.variants!r}")
    per_seed = {}
    for seed in tqdm(seeds, desc="digits, per seed"):
        argv = ["--models", "digits", "--variants", args.variants, "--seed", str(seed)]
        per_seed[seed] = fp8_training.main([*argv, "--steps", str(args.steps)])
    rows = aggregate(per_seed)
    model_name, flags = cpu_info()
    result = {
        "rule": RULE,
        "seeds": seeds,
        "environment": per_seed[seeds[0]]["environment"],
        "rows": rows,
        "per_seed": per_seed,
    }
    md = markdown(result)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"fp8_training_seeds_{args.tag or fp8_training.cpu_tag(model_name, flags)}"
        (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / f"{name}.md").write_text(md + "\n")
    return result


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    has = ", ".join(f for f, on in env["cpu_flags"].items() if on) or "none"
    lacks = ", ".join(f for f, on in env["cpu_flags"].items() if not on) or "none"
    rows = [
        {**r, "per_seed": " ".join(f"{a:.4f}" for a in r["accuracies"])} for r in result["rows"]
    ]
    lines = [
        "# Digits under each format, over seeds",
        "",
        f"- Machine: {env['cpu_model']} (/proc/cpuinfo lists {has}; not {lacks}); "
        f"jax {env.get('jax')}.",
        f"- Seeds: {', '.join(map(str, result['seeds']))}; the FP8 training benchmark's "
        "digits run (`python -m benchmarks.fp8_training --models digits`) for each.",
        f"- Rule, fixed before these seeds were run: {result['rule']}.",
        "",
        markdown_table(
            rows,
            [
                ("variant", "variant"),
                ("per_seed", "held-out accuracy per seed"),
                ("mean_accuracy", "held-out accuracy, mean"),
                ("sd", "sd over seeds"),
                ("gap_to_bf16_points", "gap to bf16 (points)"),
                ("follows_bf16", "follows bf16"),
                ("nonfinite_steps", "non-finite steps"),
            ],
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
