"""The ``jaxamp`` command line: ``jaxamp compare`` (also ``python -m jaxamp compare``)."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from jaxamp._src.errors import valid_choices

# The compare app needs the ``compare`` extra (tqdm, matplotlib, tensorflow-datasets, scipy,
# scikit-learn, pillow); without it the command says which extra to install. The app
# imports some of them only when it uses them, so each is looked for up front.
COMPARE_EXTRA = ("tqdm", "matplotlib", "tensorflow_datasets", "sklearn", "scipy", "PIL")
try:
    from jaxamp._src.compare.app import compare
    from jaxamp._src.compare.choice import CPU_CONVNET, MODEL_SHAPES
    from jaxamp._src.compare.config import MODELS, CompareConfig, OptionError
    from jaxamp._src.compare.data import DATA_SOURCES
    from jaxamp._src.compare.report import check_writable, format_table, write_report
    from jaxamp._src.compare.variants import AUTO, VARIANTS
except ImportError as e:  # an optional dependency of the app is missing or broken
    _broken = [m for m in COMPARE_EXTRA if m == (e.name or "").split(".")[0] or m in str(e)]
    if not _broken:
        raise
    _MISSING: str | None = f"{_broken[0]} ({e})"
else:
    _MISSING = None


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _count_or_all(value: str) -> int | None:
    return None if value == "all" else _positive(value)


def _variants(value: str) -> tuple[str, ...]:
    names = tuple(v.strip().lower() for v in value.split(",") if v.strip())
    unknown = [v for v in names if v not in VARIANTS and v != AUTO]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown variant(s) {', '.join(unknown) or repr(value)}. "
            f"{valid_choices([*VARIANTS, AUTO])}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``jaxamp compare`` and its options, grouped as the report is."""
    parser = argparse.ArgumentParser(
        prog="jaxamp", description="Automatic mixed precision for JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser(
        "compare",
        help="train one model in FP32 and mixed precision, side by side",
        description="Train the same model from the same initialisation on the same data "
        "order under several precision variants and compare time, memory and accuracy.",
    )
    defaults = CompareConfig()
    for add in (_what_to_compare, _how_to_train, _which_data, _what_to_check, _model_shape):
        add(compare, defaults)
    compare.add_argument(
        "--out", default=None, help="folder for report.json, report.md and PNG plots"
    )
    return parser


def _what_to_compare(compare: argparse.ArgumentParser, defaults: CompareConfig) -> None:
    """The model and the variants compared."""
    compare.add_argument(
        "--model",
        choices=MODELS,
        default=defaults.model,
        help="resnet50/resnet18 on FashionMNIST, bert on IMDB; auto: the model that shows "
        "AMP on this machine (ResNet50 on a GPU or TPU, a BERT-shaped transformer on a CPU "
        f"with bf16 units, a ResNet18 of width {CPU_CONVNET['width']} on a CPU without bf16 "
        "units; the shape "
        "options below that you set to other than their defaults are kept) "
        "(default %(default)s)",
    )
    compare.add_argument(
        "--variants",
        type=_variants,
        default=None,
        help=f"comma-separated, from {', '.join(VARIANTS)} and auto (the policy "
        "jaxamp.suggest_policy measures on the first batch; auto alone runs it beside the "
        "default variants) (default: fp32 against the variant auto_policy picks; fp32 and "
        "bf16 on a CPU)",
    )


def _how_to_train(compare: argparse.ArgumentParser, defaults: CompareConfig) -> None:
    """Epochs, batches, examples, learning rate and seeds."""
    compare.add_argument("--epochs", type=_positive, default=defaults.epochs)
    compare.add_argument("--batch-size", type=_positive, default=defaults.batch_size)
    compare.add_argument(
        "--train-examples",
        type=_count_or_all,
        default=defaults.train_examples,
        help="training examples to use, or 'all' (default %(default)s)",
    )
    compare.add_argument(
        "--test-examples",
        type=_count_or_all,
        default=defaults.test_examples,
        help="test examples to evaluate, or 'all' (default %(default)s)",
    )
    compare.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="Adam learning rate (default 1e-3 for ResNets, 1e-4 for BERT)",
    )
    compare.add_argument("--seed", type=int, default=defaults.seed)
    compare.add_argument(
        "--seeds",
        type=_positive,
        default=defaults.seeds,
        help="runs with seeds seed, seed+1, ...: accuracy is reported with its spread and "
        "read against it (default %(default)s)",
    )


def _which_data(compare: argparse.ArgumentParser, defaults: CompareConfig) -> None:
    """Where the data comes from."""
    compare.add_argument(
        "--data",
        choices=DATA_SOURCES,
        default=defaults.data,
        help="tfds: real dataset only; embedded: offline fallback only; auto: "
        "tfds, else the fallback (default)",
    )
    compare.add_argument("--data-dir", default=None, help="tensorflow-datasets data directory")


def _what_to_check(compare: argparse.ArgumentParser, defaults: CompareConfig) -> None:
    """BatchNorm recalibration and the numerics checks."""
    compare.add_argument(
        "--bn-recalibration",
        type=int,
        default=defaults.bn_recalibration,
        help="training batches that refresh BatchNorm statistics at the final "
        "weights before evaluation; 0 to evaluate as trained "
        "(default %(default)s)",
    )
    compare.add_argument(
        "--no-numerics",
        dest="numerics",
        action="store_false",
        help="skip the per-layer divergence from fp32, the float16 range check and the "
        "search for the first non-finite layer of a diverging run",
    )


def _model_shape(compare: argparse.ArgumentParser, defaults: CompareConfig) -> None:
    """The shapes of the ResNet and of the BERT."""
    auto = "; --model auto picks the shape for this machine, keeping what you give"
    compare.add_argument(
        "--width",
        type=_positive,
        default=defaults.width,
        help=f"ResNet first-stage channels (default {MODEL_SHAPES['resnet50']['width']}{auto})",
    )
    for name in ("layers", "hidden", "heads", "seq-len", "vocab-size"):
        own = MODEL_SHAPES["bert"][name.replace("-", "_")]
        extra = "; left out with --hidden given: hidden / 64" if name == "heads" else ""
        compare.add_argument(
            f"--{name}",
            type=_positive,
            default=getattr(defaults, name.replace("-", "_")),
            help=f"BERT {name} (default {own}{extra}{auto})",
        )


def missing_extra() -> str | None:
    """Why ``jaxamp compare`` cannot run here (the ``compare`` extra is missing), or ``None``."""
    missing = _MISSING
    if missing is None:
        absent = [m for m in COMPARE_EXTRA if importlib.util.find_spec(m) is None]
        missing = ", ".join(absent) if absent else None
    if missing is None:
        return None
    return (
        f"jaxamp compare needs the 'compare' extra (it could not import {missing}): "
        "pip install 'jaxamp[compare]' (from a checkout: pip install -e '.[compare]')"
    )


def main(argv: list[str] | None = None) -> int:
    why = missing_extra()
    if why is not None:
        print(f"jaxamp: error: {why}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        fields = {k: v for k, v in vars(args).items() if k not in ("command", "out")}
        try:  # every option, the output folder and the data checked before any work;
            # the folder is made only once the report is written
            config = CompareConfig(**fields)
            if args.out is not None:
                check_writable(args.out)
            report = compare(config)
        except OptionError as e:
            print(f"jaxamp compare: error: {e}", file=sys.stderr)
            return 2
        print()
        print(format_table(report))
        print(f"\ndata: {report['dataset']['source']}")
        if args.out:
            paths = write_report(report, args.out)
            print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
