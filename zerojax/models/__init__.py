"""``zerojax.models.gpt``: the reference GPT, kept at its earlier spelling;
it lives in :mod:`zerojax.app.gpt` (the application)."""
