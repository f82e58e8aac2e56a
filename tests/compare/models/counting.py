"""Parameter counting shared by the tests of jaxamp/_src/compare/models."""

import jax
import numpy as np


def flax_param_count(model, *inputs):
    """Parameters of ``model`` for ``inputs``, from shapes only (nothing is allocated)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *inputs))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
