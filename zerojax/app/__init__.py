"""The application built on zerojax: the main job (``python -m
zerojax.train``), the reference GPT, its embedded corpus, the GPT planner,
plots and MFU tables. It uses the library through its public API only;
the library never imports it. Its own dependencies (``tqdm``,
``matplotlib``) come with ``pip install 'zerojax[app]'``."""
