"""Test set-up: 8 fake CPU devices, set before JAX initialises its backend."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def mesh():
  import zerojax
  assert len(jax.devices()) == 8, "tests need 8 fake CPU devices"
  return zerojax.make_mesh()
