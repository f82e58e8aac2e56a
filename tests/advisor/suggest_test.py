"""``jaxamp.suggest_policy`` (jaxamp/_src/advisor/suggest.py): on models with a precision fault
planted as a user writes it, it keeps the faulty layer in float32; on clean models it keeps
nothing; and what it suggests is checked against the model in float32, not against its own
measurement."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from benchmarks import advisor
from tests.helpers.promotion import FLAX, OPTAX, OTHER_LIBRARY

# one worker runs them all, so that each case is measured once (``_advised``)
pytestmark = pytest.mark.xdist_group("advisor")
_BY_NAME = {case.name: case for case in advisor.CASES}


@functools.cache
def _advised(name):
    """``suggest_policy`` on the hit list's case ``name``, and its record."""
    return advisor.run_case(_BY_NAME[name])


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("case", advisor.CASES, ids=lambda case: case.name)
def test_the_advisor_keeps_each_fault_wider_and_nothing_on_clean_models(case):
    advice, record = _advised(case.name)
    assert record["hit"], (record, str(advice))
    assert set(advice.reasons) == set(advice.overrides)
    assert all(advice.overrides[k] == "float32" for k in advice.overrides)
    assert jaxamp.get_policy(str(advice.policy)) == advice.policy  # the string parses back


@pytest.mark.slow
@pytest.mark.standard_promotion(OTHER_LIBRARY)
@pytest.mark.parametrize("case", advisor.TRANSFORMERS_CASES, ids=lambda case: case.name)
def test_the_advisor_keeps_nothing_on_transformers_models(case):
    pytest.importorskip("transformers")
    advice, record = advisor.run_case(case)
    assert record["hit"], (record, str(advice))


def _relative(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return np.inf
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("name", ["NormNet", "LoudNet", "TinyEmbedNet"])
def test_the_suggestion_fixes_what_the_plain_policy_gets_wrong_in_linen(name):
    """Against the Linen model in float32: its logits under the plain candidate are far
    off (or not finite), and under the suggestion as close as the policy's rounding
    allows."""
    case = _BY_NAME[name]
    _, (params, x, _), keywords = case.build()
    advice, _ = _advised(name)
    model = keywords["model"]
    variables = {"params": params}
    ref = jax.jit(model.apply)(variables, x)
    plain = jax.jit(jaxamp.linen.apply_policy(model, case.candidates[0]).apply)(variables, x)
    fixed = jax.jit(advice.apply(model).apply)(variables, x)
    assert _relative(fixed, ref) < 0.02, _relative(fixed, ref)
    assert _relative(plain, ref) > 5 * _relative(fixed, ref), (_relative(plain, ref), str(advice))


@pytest.mark.standard_promotion(FLAX)
def test_the_suggestion_fixes_the_hand_layer_norm_in_nnx():
    _, (model, x, _), _ = _BY_NAME["NnxNormNet"].build()
    advice, _ = _advised("NnxNormNet")
    assert advice.overrides["norm"] == "float32" and set(advice.overrides) <= {"norm", "embed"}
    assert model.norm.dtype == jnp.float32  # the model given is left as it is
    ref = model(x)
    plain = jaxamp.nnx.apply_policy(nnx.clone(model), "mixed_bfloat16")(x)
    fixed = advice.apply(nnx.clone(model))(x)
    assert _relative(fixed, ref) < 0.02 < 0.1 < _relative(plain, ref)


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("name", ["loud function", "tiny function"])
def test_the_suggestion_fixes_a_function_under_autocast(name):
    loss, (params, x, y), _ = _BY_NAME[name].build()
    advice, _ = _advised(name)
    grad = lambda f: jax.jit(jax.value_and_grad(f))(params, x, y)
    ref = grad(loss)
    plain = grad(jaxamp.autocast(loss, "mixed_float16"))
    fixed = grad(advice.apply(loss))
    errors = [_relative(jnp.concatenate([g.ravel() for g in jax.tree.leaves(run[1])]),
                        jnp.concatenate([g.ravel() for g in jax.tree.leaves(ref[1])]))
              for run in (plain, fixed)]  # fmt: skip
    assert errors[1] < 0.02 and errors[0] > 5 * errors[1], errors


def _dense(params, x):
    with jax.named_scope("dense"):
        h = jnp.tanh(x @ params["kernel"])
    return jnp.mean(h**2)


_DENSE_ARGS = (
    {"kernel": jax.random.normal(jax.random.key(0), (32, 32)) / 6},
    jax.random.normal(jax.random.key(1), (8, 32)),
)


def test_float32_is_suggested_when_no_candidate_holds_and_each_verdict_says_why():
    case = _BY_NAME["NormNet"]
    loss, args, keywords = case.build()
    advice = jaxamp.suggest_policy(
        loss, *args, candidates=case.candidates, max_overridden=0.1, progress=False, **keywords
    )
    assert advice.policy == jaxamp.get_policy("float32") and not advice.overrides
    (trial,) = advice.trials
    assert not trial.accepted and "would keep 1 of 4 layers" in trial.verdict, trial.verdict
    assert "norm" in trial.reasons and "not finite" in trial.reasons["norm"], trial.reasons


def test_a_fault_outside_any_layer_refuses_the_candidate():
    """An overflow in the loss's own code (no named scope) is no layer's to keep wider."""

    def loss(w, x):
        return jnp.mean(jnp.tanh((x @ w) / 1e5))

    w, x = jnp.full((8, 8), 2e4), jnp.ones((4, 8))
    advice = jaxamp.suggest_policy(loss, w, x, candidates=["mixed_float16"], progress=False)
    assert advice.policy == jaxamp.get_policy("float32")
    assert "outside any layer" in advice.trials[0].verdict, advice.trials[0].verdict


def test_a_float32_candidate_is_accepted_as_it_is():
    advice = jaxamp.suggest_policy(_dense, *_DENSE_ARGS, candidates=["float32"], progress=False)
    assert advice.policy == jaxamp.get_policy("float32") and advice.trials[0].accepted
    assert all(r["scale_error"] == 0 for r in advice.trials[0].rows)


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="mixed_float8"):
        jaxamp.suggest_policy(_dense, *_DENSE_ARGS, candidates=["mixed_float8_delayed"])
    with pytest.raises(ValueError, match="bfloat17"):
        jaxamp.suggest_policy(_dense, *_DENSE_ARGS, candidates=["bfloat17"])
    with pytest.raises(TypeError, match=r"flax\.linen\.Module"):
        jaxamp.suggest_policy(_dense, *_DENSE_ARGS, model=_dense)
    with pytest.raises(TypeError, match="arguments"):
        jaxamp.suggest_policy(_dense)


def test_the_evidence_reads_as_a_table_and_a_plot(tmp_path):
    advice, _ = _advised("NormNet")
    table = advice.table()
    header = "| layer | pass | note | mixed_bfloat16 as it is | mixed_bfloat16 with overrides |"
    assert header in table, table
    rows = [line for line in table.splitlines() if line.startswith("| NormNet/norm | forward")]
    assert len(rows) == 1 and rows[0].count("⚠") == 1, rows  # as it is, not with overrides
    assert "norm -> float32" in str(advice) and "mixed_bfloat16: accepted" in str(advice)
    advice.plot(tmp_path / "advice.png")
    assert (tmp_path / "advice.png").stat().st_size > 10_000


class _Block(nn.Module):
    """embed (a mean of 16) -> the hand-written LayerNorm -> out."""

    @nn.compact
    def __call__(self, h):
        h = nn.Dense(32, name="embed", bias_init=nn.initializers.constant(16.0))(h)
        h = advisor.HandLayerNorm(name="norm")(h)
        return nn.Dense(16, name="out")(h)


class _Shared(nn.Module):
    """One block called twice: each of its layers has two outputs."""

    def setup(self):
        self.blk = _Block()
        self.head = nn.Dense(3)

    def __call__(self, x):
        return self.head(self.blk(self.blk(x)))


class _Bracketed(nn.Module):
    """A block whose name holds glob characters."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(_Block(name="blk[0]")(x))


def _square_loss(model, params, x):
    return jnp.mean(model.apply(params, x) ** 2)


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("model, kept", [(_Shared(), "blk/norm"), (_Bracketed(), "blk[[]0]/norm")])
def test_a_layer_run_twice_or_named_with_glob_characters_is_the_one_kept(model, kept):
    """A shared block's second pass shows the first pass's fault at its embed first; a
    name with brackets must be escaped to match its own layer. Against the model in
    float32: the suggestion's output is close where the plain policy's is not finite."""
    x = jax.random.normal(jax.random.key(1), (16, 16))
    params = model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an override that matches no layer warns
        advice = jaxamp.suggest_policy(
            _square_loss, params, x, model=model, candidates=["mixed_bfloat16"], progress=False
        )
        fixed = jax.jit(advice.apply(model).apply)(params, x)
    assert advice.policy == jaxamp.get_policy("mixed_bfloat16"), str(advice)
    assert set(advice.overrides) == {kept}, str(advice)
    assert _relative(fixed, jax.jit(model.apply)(params, x)) < 0.05


class _NormThenBatchNorm(nnx.Module):
    """Flax's own LayerNorm, then BatchNorm, which cancels the LayerNorm's scale and bias:
    their float32 gradients are about zero."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.ln(self.lin(x)))))


@pytest.mark.standard_promotion(FLAX)
def test_gradients_that_are_zero_in_float32_refuse_nothing():
    model = _NormThenBatchNorm(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, 16))
    y = jnp.arange(16) % 3
    advice = jaxamp.suggest_policy(
        advisor.nnx_loss, model, x, y, candidates=["mixed_bfloat16"], progress=False
    )
    assert advice.policy == jaxamp.get_policy("mixed_bfloat16"), str(advice)
    assert not advice.overrides, str(advice)


def test_a_loss_that_is_not_a_floating_scalar_is_refused_naming_what_it_returns():
    with pytest.raises(TypeError, match=r"suggest_policy.*scalar.*float32\[8, 32\]"):
        jaxamp.suggest_policy(lambda p, x: jnp.tanh(x @ p["kernel"]), *_DENSE_ARGS)
    with pytest.raises(TypeError, match=r"suggest_policy.*got tuple.*\[0\]"):
        jaxamp.suggest_policy(lambda p, x: (_dense(p, x), x), *_DENSE_ARGS)


def _outlier_first(params, x, y):
    """A first layer whose input holds one outlier feature (1e6 beside values of about
    1): scaled per tensor from it, float8 e4m3 rounds the rest to zero."""
    with jax.named_scope("first"):
        h = jnp.tanh(x @ params["first"] / 1e3)
    with jax.named_scope("head"):
        logits = h @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.standard_promotion(OPTAX)
def test_a_first_layer_float8_flushes_is_kept_and_a_clean_one_is_not():
    """Against a numpy count: the share of the first GEMM's input that e4m3 under a
    per-tensor scale rounds to zero."""
    import ml_dtypes

    x = jax.random.normal(jax.random.key(1), (16, 32)).at[:, 0].set(1e6)
    params = {
        "first": jax.random.normal(jax.random.key(2), (32, 32)) / 6,
        "head": jax.random.normal(jax.random.key(3), (32, 3)) / 6,
    }
    y = jnp.arange(16) % 3
    a = np.abs(np.asarray(x, np.float64))
    scaled = (a / (a.max() / 448.0)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert ((scaled == 0) & (a > 0)).mean() > 0.9  # the reference: most of x flushes
    advice = jaxamp.suggest_policy(
        _outlier_first, params, x, y, candidates=["mixed_float8"], progress=False
    )
    assert advice.policy == jaxamp.get_policy("mixed_float8"), str(advice)
    assert set(advice.overrides) == {"first"} and "e4m3" in advice.reasons["first"], str(advice)
    clean = jaxamp.suggest_policy(
        _outlier_first, params, x.at[:, 0].set(1.0), y, candidates=["mixed_float8"], progress=False
    )
    assert clean.policy == jaxamp.get_policy("mixed_float8") and not clean.overrides, str(clean)
