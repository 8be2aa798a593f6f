"""Layouts and records: meshes (and the Auto region on Explicit axes),
precision policies, model specs, the one layout rule, ZeRO++ settings,
``ZeroConfig`` and the state records. Imports nothing else of zerojax."""
