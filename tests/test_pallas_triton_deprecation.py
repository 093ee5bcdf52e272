"""JAX 0.11 deprecates Pallas' Triton backend, which our GPU kernels use; a later release removes it. These
tests notice when the deprecation becomes anything stronger than a warning, and keep JAX pinned below the
removal.

On the H200 (JAX 0.11.2) lowering a kernel warned, as a DeprecationWarning: "The Pallas Triton backend is
deprecated and will be removed in a future JAX version. To keep using Pallas on GPU, please migrate to the
Mosaic GPU backend. To keep using Triton, switch to the official Triton bindings and jax_triton." JAX 0.10.2
lowers it silently.
"""

import os
import re
import warnings

import jax
import jax.numpy as jnp
from jax._src import deprecations

from pallas_kernels.paged_kv_write import kernel as kv_write_kernel

DEPRECATION_ID = "jax-pallas-triton"
PYPROJECT = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")


def test_a_kernel_lowers_for_cuda_with_at_most_a_deprecation_warning():
    cache = jax.ShapeDtypeStruct((2, 8, 16, 2, 64), jnp.bfloat16)  # (L, P, S, Hkv, D)
    kv = jax.ShapeDtypeStruct((8, 2, 64), jnp.bfloat16)  # (T, Hkv, D)
    slots = jax.ShapeDtypeStruct((8,), jnp.int32)  # (T,)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = jax.jit(lambda *a: kv_write_kernel.write_kv(*a[:2], 1, *a[2:])).trace(
            cache, cache, kv, kv, slots).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
    about_triton = [w for w in caught if "triton" in str(w.message).lower()]
    assert all(issubclass(w.category, DeprecationWarning) for w in about_triton), [str(w.message) for w in about_triton]


def test_the_triton_deprecation_is_not_accelerated():
    """An accelerated deprecation raises instead of warning: the kernels would stop compiling."""
    if DEPRECATION_ID in deprecations._registered_deprecations:  # JAX 0.11 registers it; 0.10 does not
        assert not deprecations.is_accelerated(DEPRECATION_ID)


def test_jax_is_pinned_below_the_release_that_removes_pallas_triton():
    with open(PYPROJECT) as f:
        pins = re.findall(r'"jax([<>=!~][^"]*)"', f.read())
    assert pins == [">=0.10.2,<0.12"]
    assert tuple(int(part) for part in jax.__version__.split(".")[:2]) < (0, 12)
