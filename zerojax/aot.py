"""Compile a step for a machine you do not hold (a TPU pod), and read the
target compiler's plan of it -- from any machine with the TPU compiler
(``pip install 'zerojax[tpu]'``), with nothing allocated.

    from zerojax import aot
    mesh = aot.topology_mesh("v5p:4x4x4")                  # 64 chips
    tx = zerojax.zero(optax.adamw(3e-4), stage=3, mesh=mesh)
    state = jax.eval_shape(lambda k: zerojax.init_from(init_fn, tx, k), key)
    batch = aot.abstract_batch({"x": ((64, 2048), jnp.int32),
                                "y": ((64, 2048), jnp.int32)})
    compiled = zerojax.train_step(loss_fn, tx).lower(state, batch).compile()
    aot.compiled_report(compiled, mesh)        # peak, collectives, overlap
"""

from zerojax._src.diagnostics.aot import abstract_batch as abstract_batch
from zerojax._src.diagnostics.aot import compiled_report as compiled_report
from zerojax._src.diagnostics.aot import topology_devices as topology_devices
from zerojax._src.diagnostics.aot import topology_mesh as topology_mesh

__all__ = [
  "abstract_batch",
  "compiled_report",
  "topology_devices",
  "topology_mesh",
]
