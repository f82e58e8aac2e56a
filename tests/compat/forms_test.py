"""Every matmul form this backend runs, on whole models: jaxamp's BERT and GPT-2 and
transformers' BERT train loss-scaled steps in bfloat16 and float16 under each form, with
losses close to float32's (the checks of ``harness.check_model``).

On a CPU the forms are ``canonical`` (bfloat16's default) and ``upcast`` (float16's);
``native`` is the GPU/TPU form, whose bfloat16 dots XLA:CPU fails to run in some layouts.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp.models import BertClassifier, BertConfig, GPT2Config, GPT2LMHeadModel
from tests.compat.harness import POLICIES, check_model
from tests.compat.transformers_test import MODELS as TRANSFORMERS
from tests.compat.transformers_test import _loss_of
from tests.helpers.promotion import FLAX

FORMS = [f for f in jaxamp.ops.MATMUL_FORMS if f != "native" or jax.default_backend() != "cpu"]


def _cases():
    """(model, policy, form); a policy's default form on this backend is what every other
    test of these models runs, so there it is ``slow``. CI runs each other (policy, form)
    pair on one model, the models in turn; the slow run, every model."""
    from jaxamp._src.ops.forms import platform_form

    i = 0
    for policy in POLICIES:
        compute = jaxamp.get_policy(policy).compute_dtype
        default = platform_form(jax.default_backend(), compute).name
        for form in FORMS:
            for j, name in enumerate(MODELS):
                in_ci = form != default and j == i % len(MODELS)
                marks = [] if in_ci else [pytest.mark.slow]
                yield pytest.param(name, policy, form, marks=marks, id=f"{name}-{policy}-{form}")
            i += form != default


IDS = jax.random.randint(jax.random.key(0), (4, 16), 1, 96)


def _jaxamp_model(module, targets, loss_of_logits, policy):
    params = module.init(jax.random.key(0), IDS)["params"]
    amp = jaxamp.linen.apply_policy(module, policy)

    def loss_with(model):
        def loss(params, batch):
            logits = model.apply({"params": params}, batch["ids"]).astype(jnp.float32)
            return loss_of_logits(logits, batch["targets"])

        return loss

    return loss_with(amp), loss_with(module), params, {"ids": IDS, "targets": targets}


def _classify(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _next_token(logits, ids):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def jaxamp_bert(policy):
    config = BertConfig(
        vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
        max_position=16, num_classes=3,
    )  # fmt: skip
    return _jaxamp_model(BertClassifier(config), jnp.arange(4) % 3, _classify, policy)


def jaxamp_gpt2(policy):
    config = GPT2Config(vocab_size=96, max_position=16, hidden_size=32, num_layers=2, num_heads=4)
    return _jaxamp_model(GPT2LMHeadModel(config), IDS, _next_token, policy)


def transformers_bert(policy):
    pytest.importorskip("transformers")
    model, inputs, targets, loss_from_outputs = TRANSFORMERS["BERT"]()
    fp32_loss = _loss_of(model, inputs, targets, loss_from_outputs)
    amp_loss = jaxamp.autocast(fp32_loss, policy)
    return amp_loss, fp32_loss, model.params, {"inputs": inputs, "targets": targets}


MODELS = {"jaxamp BERT": jaxamp_bert, "jaxamp GPT-2": jaxamp_gpt2, "BERT": transformers_bert}


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize(("name", "policy", "form"), list(_cases()))
def test_models_train_under_every_form(name, policy, form):
    amp_loss, fp32_loss, params, batch = MODELS[name](policy)
    with jaxamp.ops.use_matmul_form(form):
        report = jaxamp.precision_report(jax.grad(amp_loss))(params, batch)
        gemms = [op for op in report.ops if op.contracts]
        assert gemms and {op.upcast for op in gemms} == {form == "upcast"}
        check_model(
            package="jaxamp" if name.startswith("jaxamp") else "transformers",
            model=name,
            path=f"form {form}",
            policy=policy,
            amp_loss=amp_loss,
            fp32_loss=fp32_loss,
            params=params,
            batch=batch,
        )
