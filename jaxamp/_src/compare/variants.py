"""The precision recipes ``jaxamp compare`` runs (``fp32``, ``tf32``, ``bf16``, ``fp16``, the
optimizer-state recipes and the float8 ones), named the same everywhere."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import optax

from jaxamp._src.backend import auto_policy
from jaxamp._src.errors import DOCS_URL, invalid_choice
from jaxamp._src.optim.loss_scaled import loss_scaled
from jaxamp._src.optim.recipes import OPTIMIZER_RECIPES, optimizer_recipe
from jaxamp._src.optim.scales import DynamicLossScale, NoOpLossScale
from jaxamp._src.policy import PRESETS, Policy, get_policy


@dataclasses.dataclass(frozen=True)
class Variant:
    """A precision recipe: policy, matmul precision for float32 inputs, loss scaling.

    Attributes:
      name: ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp8-delayed"``,
        ``"mxfp8"``, ``"nvfp4"`` or an optimizer-state recipe's name.
      policy: the ``jaxamp.Policy`` applied to the model.
      matmul_precision: ``jax.default_matmul_precision`` while tracing (affects
        float32 matmuls only), or ``None`` for JAX's default.
      dynamic_loss_scaling: wrap the optimizer in ``jaxamp.loss_scaled``.
      description: one line for reports.
      optimizer_recipe: a key of ``jaxamp.optim.OPTIMIZER_RECIPES`` whose optimizer
        wraps the inner one (its policy is ``policy``), or ``None``.
      overrides: ``(layer path, policy)`` pairs ``apply_policy`` takes with ``policy``
        (the ``auto`` variant's, from ``jaxamp.suggest_policy``).
    """

    name: str
    policy: Policy
    matmul_precision: str | None
    dynamic_loss_scaling: bool
    description: str
    optimizer_recipe: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()

    def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
        """``inner``, wrapped in dynamic loss scaling or the optimizer-state recipe."""
        if self.optimizer_recipe is not None:
            return optimizer_recipe(self.optimizer_recipe, inner, loss_scale=NoOpLossScale())[1]
        if self.dynamic_loss_scaling:
            return loss_scaled(inner, DynamicLossScale())
        return inner

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Context to trace and compile this variant's functions in."""
        if self.matmul_precision is None:
            yield
        else:
            with jax.default_matmul_precision(self.matmul_precision):
                yield


VARIANTS: dict[str, Variant] = {
    "fp32": Variant(
        "fp32",
        PRESETS["float32"],
        "highest",
        False,
        "float32, highest matmul precision (true FP32)",
    ),
    "tf32": Variant(
        "tf32",
        PRESETS["float32"],
        None,
        False,
        "float32, default matmul precision (TF32 on Ampere and newer)",
    ),
    "bf16": Variant(
        "bf16",
        PRESETS["mixed_bfloat16"],
        None,
        False,
        "mixed_bfloat16: float32 params, bfloat16 compute",
    ),
    "fp16": Variant(
        "fp16", PRESETS["mixed_float16"], None, True, "mixed_float16 with dynamic loss scaling"
    ),
}
# The precision recipes of the table above; the benchmark suite's default variants.
PRECISION_VARIANTS = tuple(VARIANTS)
_RECIPE_DESCRIPTIONS = {
    "bf16_float32_master": "bfloat16 params and compute, float32 master, float32 Adam moments",
    "bf16_kahan": "bfloat16 params and compute, bfloat16 Kahan compensation, float32 moments",
    "bf16_stochastic": "bfloat16 params, compute and Adam moments, stochastic rounding",
    "bf16_naive": "bfloat16 params and compute rounded to nearest, no master (the baseline)",
}
for _name, _description in _RECIPE_DESCRIPTIONS.items():
    VARIANTS[_name] = Variant(
        _name, get_policy(OPTIMIZER_RECIPES[_name][0]), None, False, _description, _name
    )
# Matmuls in float8 (guides/fp8.md). Delayed scaling keeps state beside the params (the
# "_overwrite_with_gradient" collection): the training step differentiates it apart and
# overwrites it with its gradient, its next value; the optimizer never sees it.
VARIANTS["fp8"] = Variant(
    "fp8",
    PRESETS["mixed_float8"],
    None,
    False,
    "mixed_float8: float32 params, bfloat16 compute, float8 matmuls, current scaling",
)
VARIANTS["fp8-delayed"] = Variant(
    "fp8-delayed",
    PRESETS["mixed_float8_delayed"],
    None,
    False,
    "mixed_float8_delayed: float32 params, bfloat16 compute, float8 matmuls, delayed "
    "scaling (amax history)",
)
# Block-scaled matmuls (guides/block-scaling.md): no state.
VARIANTS["mxfp8"] = Variant(
    "mxfp8",
    PRESETS["mixed_mxfp8"],
    None,
    False,
    "mixed_mxfp8: float32 params, bfloat16 compute, MXFP8 matmuls (e4m3, a power-of-two "
    "scale per 32 values)",
)
VARIANTS["nvfp4"] = Variant(
    "nvfp4",
    PRESETS["mixed_nvfp4"],
    None,
    False,
    "mixed_nvfp4: float32 params, bfloat16 compute, NVFP4 matmuls (e2m1, an e4m3 scale per "
    "16 values and a float32 scale per tensor; gradients rounded stochastically)",
)


AUTO = "auto"
"""The variant ``jaxamp.suggest_policy`` picks for the model on its first batch, made when
the comparison starts (``jaxamp._src.compare.suggested``)."""


def expand_variants(names: tuple[str, ...] | None) -> list[str]:
    """The variants to run: ``default_variants()`` for ``None``; ``auto`` alone beside
    them (``fp32`` and the preset this device would train in), so that its claim is read
    against each in about the default run's time; anything else as given.

    Examples:
      >>> import jax
      >>> jax.default_backend() != "cpu" or expand_variants(("auto",))
      ['fp32', 'bf16', 'auto']
      >>> expand_variants(("fp32", "auto"))
      ['fp32', 'auto']
    """
    if names is None:
        return default_variants()
    if tuple(names) == (AUTO,):
        return [*default_variants(), AUTO]
    return list(names)


def get_variant(name: str) -> Variant:
    """The ``Variant`` called ``name``.

    Raises:
      ValueError: for an unknown name, listing the valid ones.
    """
    try:
        return VARIANTS[name.strip().lower()]
    except KeyError as e:
        raise invalid_choice("variant", name, VARIANTS) from e


def default_variants(device: jax.Device | None = None) -> list[str]:
    """``fp32`` against the mixed precision this device would train in.

    On a CPU, where ``auto_policy`` keeps float32 as the default, ``bf16`` is compared with
    ``fp32``; ``fp16`` is not (``FP16_ON_CPU`` says why; ``--variants
    fp32,bf16,fp16`` adds it). Elsewhere, where ``auto_policy`` picks float32 (a GPU
    without tensor cores), ``bf16`` and ``fp16`` (with dynamic loss scaling) are.

    Examples:
      >>> default_variants()[0]
      'fp32'
    """
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return ["fp32", "bf16"]
    picked = auto_policy(device)
    if picked == PRESETS["mixed_bfloat16"]:
        return ["fp32", "bf16"]
    if picked == PRESETS["mixed_float16"]:
        return ["fp32", "fp16"]
    return ["fp32", "bf16", "fp16"]


FP16_ON_CPU = (
    "fp16 is not among the default variants on a CPU: XLA:CPU has no float16 GEMM "
    "kernels (not even with avx512_fp16), so float16 runs slower than float32 there "
    f"({DOCS_URL}/benchmarks.md); --variants fp32,bf16,fp16 compares it too, with its loss scaling"
)
