"""``python -m zerojax.train``: the main job (part of the application,
:mod:`zerojax.app.train`, its flags in :mod:`zerojax.app.train_config`)."""

from zerojax.app.train import main
from zerojax.app.train_config import TrainConfig as TrainConfig
from zerojax.app.train_config import check as check
from zerojax.app.train_config import parse_args as parse_args
from zerojax.app.train_config import resolve as resolve

__all__ = ["TrainConfig", "check", "parse_args", "resolve"]

if __name__ == "__main__":
  raise SystemExit(1 if main(parse_args())["diverged_at"] is not None else 0)
