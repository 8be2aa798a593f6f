"""The classes a value of a loss's jaxpr takes in
:mod:`zerojax._src.jaxpr.batch_mean`'s reading, and the two exceptions its
rules raise: :class:`Mixes` (the value mixes examples, class ``X``) and
:class:`Unknown` (the rule cannot follow it, class ``U``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class C:
  uniform: frozenset = frozenset()  # axes along which the value is constant
  val: object = None  # the value when known and small (numpy)
  pos: int | None = None  # an iota's axis (a position, not data)
  noise: bool = False  # drawn from a key: independent per element
  fill: object = None  # every element's value, when all are the same
  lits: frozenset = frozenset()  # known numbers folded into it (row_count)


@dataclasses.dataclass(frozen=True)
class R:
  d: int
  m: int = 1
  scale: float = 1.0  # literal factors applied to the examples so far

  @property
  def layout(self):
    return (self.d, self.m)


@dataclasses.dataclass(frozen=True)
class RK:
  """The rows in chunks of whole examples: axis ``d`` indexes the chunks,
  axis ``d + 1`` holds each chunk's rows as :class:`R` (``m`` elements per
  example). Read only as a scan's input over ``d`` (``batch_mean``)."""

  d: int
  m: int = 1
  scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class S:
  coefs: tuple = (1.0,)
  at: str = dataclasses.field(default="", compare=False)  # the first sum
  offset: bool = False  # a constant (not a known 0) added to the sums


@dataclasses.dataclass(frozen=True)
class X:
  reason: str


@dataclasses.dataclass(frozen=True)
class U:
  reason: str


@dataclasses.dataclass(frozen=True)
class IX:
  """An index array (last axis: the index vector) built per row ``d``,
  with each vector entry an iota over the rows (``"I"``) or data."""

  d: int
  comps: tuple


class Unknown(Exception):
  pass


class Mixes(Exception):
  pass
