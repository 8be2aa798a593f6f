"""Collectives: the ``gather`` primitive (custom VJP: all-gather forward,
reduce-scatter backward), constant-size buckets, ZeRO++'s quantized
collectives and hpZ. Reads the records."""
