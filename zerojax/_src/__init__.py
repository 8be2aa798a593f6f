"""zerojax's engine, behind the public namespaces (``zerojax``, ``zerojax.cost``,
``zerojax.checkpoint``, ...), in folders by concern, each importing only
the folders below it (``docs/architecture.md``; import-linter checks it):

* ``records``: meshes, precision, the layout rule, ZeRO++ settings,
  ``ZeroConfig`` and the state records (``StateSpec``, ``ZeroState``);
* ``comm``: the collectives: the gather primitive, buckets, ZeRO++'s
  quantized collectives;
* ``jaxpr``: reading traced programs: the loss audit, saved activations,
  output-input dependencies;
* ``step``: init, the gradient and optimizer halves of a step, offload,
  the drop-in and ``zero()``;
* ``diagnostics``, ``ckpt``, ``interop``: what a step costs (one cost model,
  the planner, the report, compiled-HLO reading), checkpoints, Flax glue;
* ``runtime``: multi-process runs and XLA flags (imports nothing above).
"""
