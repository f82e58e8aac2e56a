"""Why a test runs under JAX's standard dtype promotion: the suite runs under
``jax_numpy_dtype_promotion="strict"`` (tests/conftest.py), so that an implicit promotion in
jaxamp raises, and a test whose subject promotes on purpose, or that runs a library whose
own code promotes, says which with ``@pytest.mark.standard_promotion(REASON)``, REASON one
of these names."""

# optax's Adam, AdamW, LAMB...: the bias correction raises a float decay to an int32 count
# (optax/tree_utils/_tree_math.py); optax.apply_updates adds float32 updates to 16-bit params
OPTAX = "optax promotes implicitly (Adam's bias correction decay**count, apply_updates)"
# flax.linen and flax.nnx: normalisation statistics, Dense's bias add, pooling's divisor,
# attention's and recurrent cells' arithmetic on a policy's 16-bit values
FLAX = "Flax's layers promote implicitly (normalisation, Dense, pooling, attention, RNN cells)"
# Equinox, Haiku and transformers' Flax models, run under a policy; jmp's own tests
OTHER_LIBRARY = "Equinox, Haiku, transformers' or jmp's own code promotes implicitly"
# The function or model under test mixes dtypes on purpose (a policy's 16-bit activations
# with float32 values of the model's own, weak with strong types): its promotion is what
# autocast, a policy or a constant rule exists to handle, or what the test asserts
SUBJECT = "the function under test promotes on purpose: its promotion is the test's subject"
