"""The warnings some tests cause on purpose, each as a named filter: the suite runs with
warnings as errors (pyproject's ``filterwarnings``), and a test that means to cause one
says which by decorating itself with the name. Each of jaxamp's own warnings also has a
test that asserts it (``pytest.warns``)."""

import pytest

# numpy's, when JAX casts a constant float16 cannot hold (-1e9, 1e30) into a 16-bit trace
FLOAT16_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
# jaxamp's, where the 'native' matmul form runs on XLA:CPU
NATIVE_FORM_ON_CPU = pytest.mark.filterwarnings(
    "ignore:The 'native' matmul form on XLA.CPU:UserWarning"
)
# jaxamp's, where with_state_dtype stores statistics in float16
FLOAT16_STATISTICS = pytest.mark.filterwarnings(
    "ignore:with_state_dtype.*stores statistics in float16:UserWarning"
)
# jaxamp's, where with_state_dtype finds nothing to cast (schedule_free, plain SGD)
NO_STATISTIC = pytest.mark.filterwarnings(
    "ignore:with_state_dtype.*found no per-parameter statistic:UserWarning"
)
# jaxamp's, for a float16 loss, whose backward pass overflows at the default scale
FLOAT16_LOSS = pytest.mark.filterwarnings("ignore:jaxamp. the loss is float16:UserWarning")
# jaxamp's, where params are differentiated under delayed float8 scaling but the state not
FP8_STATE_NOT_DIFFERENTIATED = pytest.mark.filterwarnings(
    "ignore:Delayed float8 scaling. the params are being differentiated:UserWarning"
)
# Flax's, for nnx.Module.sow outside nnx.capture (a model written the way Flax deprecates,
# which users still have)
NNX_SOW_OUTSIDE_CAPTURE = pytest.mark.filterwarnings(
    "ignore:Using 'Module.sow..' outside of 'nnx.capture..' is deprecated:DeprecationWarning"
)
