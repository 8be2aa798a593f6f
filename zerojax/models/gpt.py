"""The reference GPT at its earlier spelling: this module is
:mod:`zerojax.app.gpt` itself."""

import sys

from zerojax.app import gpt as _gpt

sys.modules[__name__] = _gpt
