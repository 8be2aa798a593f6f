"""Reading traced programs: whether a loss uses sharded params only through
``gather`` (the audit), which activations a step saves, which outputs of a
jaxpr read which inputs."""
