"""The fault corpus: the inf and NaN faults mixed precision meets most, each at a known
operation, plain and inside a ``lax.scan``. For each, ``find_nonfinite`` must name the
first operation (phase, primitive, layer, source line, loop iteration) and
``range_report(...).recommend()`` must give the advice that fixes it.

Every case is one step ``h -> (h', loss term)``, taken twice: unrolled, or as the body
of a ``lax.scan`` (where the fault is in one iteration)."""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from tests.helpers.expected_warnings import FLOAT16_OVERFLOW

# The planted faults include a mask constant float16 cannot hold: JAX's cast of it warns.
pytestmark = FLOAT16_OVERFLOW

H = jnp.array([[0.5, -1.0, 1.5, 0.25], [1.0, 0.75, -0.5, 2.0]])
KEEP = jnp.array([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]])


def line_of(fun: Callable, text: str) -> str:
    """``faults_test.py:<line> (<fun>)`` of the line of ``fun`` holding ``text``."""
    lines, start = inspect.getsourcelines(fun)
    line = start + next(i for i, s in enumerate(lines) if text in s)
    return f"faults_test.py:{line} ({fun.__name__})"


# --- the steps, each with its fault on a line of its own ----------------------------------
# Each is step(h, w, mask, dtype): the dtype it computes in, where that is a choice.


def float16_mask(h, w, mask, dtype):
    with jax.named_scope("attn"):
        s = (h @ w).astype(jnp.float16)
        s = s - 1e30 * (1 - mask.astype(jnp.float16))  # 1e30 is inf in float16
        p = jax.nn.softmax(s, axis=-1).astype(jnp.float32)
    return h + p, jnp.sum(p * h)


def masked_row(h, w, mask, dtype):
    with jax.named_scope("attn"):
        s = (h @ w).astype(dtype)
        s = jnp.where(mask > 0, s, -jnp.inf)  # a row that keeps nothing: 0 / 0
        p = jax.nn.softmax(s, axis=-1).astype(jnp.float32)
    return h + p, jnp.sum(p * h)


def log_zero(h, w, mask, dtype):
    h = h @ w
    with jax.named_scope("loss"):
        term = -jnp.mean(jnp.log(jax.nn.relu(h.astype(dtype))))  # log(0) where h <= 0
    return h * 0.5, term.astype(jnp.float32)


def sqrt_zero(h, w, mask, dtype):
    with jax.named_scope("root"):
        r = jnp.sqrt(jax.nn.relu((h @ w).astype(dtype)))  # d sqrt(u)/du = inf at u = 0
    return h + r.astype(jnp.float32), jnp.sum(r.astype(jnp.float32))


def overflow(h, w, mask, dtype):
    with jax.named_scope("big"):
        h = h.astype(jnp.float16) @ w.astype(jnp.float16)  # 4 * 3e4 > 65504
    return h.astype(jnp.float32) * 1e-5, jnp.sum(h.astype(jnp.float32))


def dense(h, w, mask, dtype):
    with jax.named_scope("dense"):
        h = jnp.tanh(h @ w)  # under mixed_float16, a float16 value
    with jax.named_scope("loss"):
        term = jnp.mean(h**2)  # its gradient, cast to float16: 2**24 * 2h/8 > 65504
    return h, term


def run_steps(step: Callable, dtype: Any, scanned: bool) -> Callable:
    def loss(w, h, mask):
        masks = jnp.stack([mask, mask])  # one per step, as a sequence model has
        if scanned:
            _, terms = jax.lax.scan(lambda h, m: step(h, w, m, dtype), h, masks)
            return jnp.sum(terms)
        total = 0.0
        for m in masks:
            h, term = step(h, w, m, dtype)
            total = total + term
        return total

    return loss


# --- the cases ------------------------------------------------------------------------------

ALL = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Case:
    step: Callable
    w: Any
    mask: Any
    fault: tuple[str, str, str]  # phase, primitive, layer
    line: str  # the text of the line that faults
    iteration: int  # which of the two steps faults (the scan's iteration)
    advice: str  # "bfloat16", "float16 with a smaller loss scale" or "not the dtype"
    policy: str | None = None
    loss_scale: float | None = None
    dtypes: tuple[Any, ...] = (None,)  # the dtypes the step computes in (None: its own)
    advice_dtypes: tuple[Any, ...] | None = None  # those the advice is known for (all)


EYE = jnp.eye(4)
CASES = {
    "float16 mask constant": Case(
        float16_mask, EYE, KEEP, ("forward", "mul", "attn"), "1e30", 0, "bfloat16"
    ),
    "fully masked row": Case(
        masked_row,
        EYE,
        KEEP.at[1].set(0.0),
        ("forward", "select_n", "attn"),
        "-jnp.inf",
        0,
        "not the dtype",
        dtypes=ALL,
        # a float16 inf constant may as well be 1e30 rounded (the case above): range_report
        # counts it as float16's, so its advice is bfloat16 there
        advice_dtypes=(jnp.float32, jnp.bfloat16),
    ),
    "log(0) in a loss": Case(
        log_zero, EYE, KEEP, ("forward", "log", "loss"), "log(", 0, "not the dtype", dtypes=ALL
    ),
    "sqrt'(0)": Case(
        sqrt_zero,
        EYE,
        KEEP,
        ("backward", "div", "root"),
        "sqrt(",
        0,
        "not the dtype",
        dtypes=ALL,
    ),
    "overflowing activation": Case(
        overflow,
        jnp.full((4, 4), 3e4),
        KEEP,
        ("forward", "dot_general", "big"),
        "@",
        0,
        "bfloat16",
    ),
    "loss scale that overflows float16": Case(
        dense,
        jnp.full((4, 4), 0.5),
        KEEP,
        ("backward", "convert_element_type", "loss"),
        "h**2",
        1,
        "float16 with a smaller loss scale",
        policy="mixed_float16",
        loss_scale=2.0**24,
    ),
}


def _params(dtypes_of: Callable[[Case], tuple[Any, ...]]) -> list[Any]:
    return [
        pytest.param(name, dtype, id=name if dtype is None else f"{name}-{jnp.dtype(dtype).name}")
        for name, case in CASES.items()
        for dtype in dtypes_of(case)
    ]


FAULTS = _params(lambda case: case.dtypes)
ADVICE = _params(lambda case: case.advice_dtypes or case.dtypes)


def the_loss(case: Case, dtype: Any, scanned: bool) -> Callable:
    loss = run_steps(case.step, dtype, scanned)
    if case.policy is not None:
        loss = jaxamp.autocast(loss, case.policy)
    return jax.jit(loss)


@pytest.mark.parametrize("scanned", [False, True], ids=["plain", "scan"])
@pytest.mark.parametrize(("name", "dtype"), FAULTS)
def test_find_nonfinite_names_the_first_operation(name, dtype, scanned):
    case = CASES[name]
    loss = the_loss(case, dtype, scanned)
    fault = jaxamp.find_nonfinite(loss, loss_scale=case.loss_scale)(case.w, H, case.mask)
    assert fault is not None, f"{name}: no fault found"
    assert (fault.phase, fault.primitive, fault.layer) == case.fault, fault
    assert fault.source.endswith(line_of(case.step, case.line)), fault.source
    assert fault.iteration == ((case.iteration,) if scanned else ()), fault
    assert fault.output.nans + fault.output.infs > 0


@pytest.mark.parametrize("scanned", [False, True], ids=["plain", "scan"])
@pytest.mark.parametrize(("name", "dtype"), ADVICE)
def test_range_report_gives_the_advice_that_fixes_it(name, dtype, scanned):
    case = CASES[name]
    loss = jax.jit(run_steps(case.step, dtype, scanned))
    report = jaxamp.range_report(loss, loss_scale=case.loss_scale, policy=case.policy)
    report = report(case.w, H, case.mask)
    advice = report.recommend()
    layer = case.fault[2]
    if case.advice == "bfloat16":
        assert advice.dtype == "bfloat16" and layer in advice.reason, advice
        assert (layer, case.fault[0]) in {(r.layer, r.phase) for r in report.overflows()}
    elif case.advice == "not the dtype":
        # inf or NaN in float32 too: no 16-bit type is the fix, and none is blamed
        assert advice.dtype == "float16" and advice.nonfinite[0] == layer, advice
        assert "float32 too" in advice.reason and "find_nonfinite" in advice.reason
    else:
        assert advice.dtype == "float16" and advice.loss_scaling, advice
        assert 1 <= advice.loss_scale < case.loss_scale and "smaller loss scale" in advice.reason
        fits = jaxamp.range_report(loss, loss_scale=advice.loss_scale, policy=case.policy)
        assert fits(case.w, H, case.mask).overflows() == []
        # and float16 does run at that scale: the step's gradients are finite
        fault = jaxamp.find_nonfinite(the_loss(case, dtype, scanned), loss_scale=advice.loss_scale)
        assert fault(case.w, H, case.mask) is None
