"""How zerojax lays a state out over a mesh, before anything is allocated:
one record per leaf, built by the rule ``zerojax.init`` follows.

    spec = zerojax.layout.make_spec(jax.eval_shape(init_fn, key), tx)
    [(leaf.path, leaf.shard.sharded) for leaf in spec.leaves]
"""

from zerojax._src.records.layout import LeafLayout as LeafLayout
from zerojax._src.records.mesh import parse_axes as parse_axes
from zerojax._src.records.spec import LeafSpec as LeafSpec
from zerojax._src.records.spec import OptLeafSpec as OptLeafSpec
from zerojax._src.records.spec import StateSpec as StateSpec
from zerojax._src.records.spec import make_spec as make_spec

__all__ = [
  "LeafLayout",
  "LeafSpec",
  "OptLeafSpec",
  "StateSpec",
  "make_spec",
  "parse_axes",
]
