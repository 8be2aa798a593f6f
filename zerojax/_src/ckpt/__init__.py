"""Checkpoints of a ``ZeroState`` with Orbax, restorable across meshes and
stages."""
