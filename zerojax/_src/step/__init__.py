"""The step: building the state (``init``, ``init_from``), the gradient
half inside ``shard_map``, the optimizer half on global arrays, offload,
``train_step`` / ``eval_step``, the Optax drop-in and ``zero()``."""
