"""The rules of :mod:`zerojax._src.jaxpr.batch_mean`'s reading of a loss
for elementwise arithmetic, and the constants' folding.

Each value of a loss's jaxpr has a class (:mod:`zerojax._src.jaxpr.classes`):
``C`` (independent of the batch's rows), ``R`` (per example), ``S``
(linear in a sum over the rows), ``X`` (mixes examples) or ``U`` (not
followed). A per-example value carries the literal factor applied to it
so far; a factor that ends up inside an example's term is recorded
(:func:`bake`), so that two traces at different row counts can show it
does not depend on them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math

import jax
import numpy as np

from zerojax._src.jaxpr.classes import IX, C, Mixes, R, S, Unknown

PASS = frozenset(
  {
    "convert_element_type",
    "copy",
    "copy_p",
    "reduce_precision",
    "stop_gradient",
    "sharding_constraint",
    "mesh_cast",
    "reshard",
    "pvary",
    "optimization_barrier",
    "real",
    "imag",
    "conj",
    "name",  # jax.ad_checkpoint.checkpoint_name
  }
)
NONLINEAR = frozenset(
  {
    "integer_pow",
    "pow",
    "sqrt",
    "rsqrt",
    "cbrt",
    "log",
    "log1p",
    "exp",
    "exp2",
    "expm1",
    "tanh",
    "logistic",
    "abs",
    "max",
    "min",
    "square",
  }
)
ELEMENTWISE = PASS | NONLINEAR
ELEMENTWISE |= frozenset(
  """add add_any sub mul div neg sign floor ceil round is_finite select_n
  clamp eq ne lt le gt ge and or not xor atan2 nextafter rem sin cos tan
  asin acos atan sinh cosh asinh acosh atanh erf erfc erf_inv lgamma digamma
  igamma igammac bessel_i0e bessel_i1e complex shift_left
  shift_right_logical shift_right_arithmetic population_count clz
  eq_to ne_to lt_to le_to gt_to ge_to polygamma zeta igamma_grad_a
  random_gamma_grad regularized_incomplete_beta
  """.split()
)
REDUCE_AXES = frozenset(
  {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}
)
# values drawn from a key (dropout's masks): noise per element, which
# a per-example value may take (each example its own draw) without
# combining examples
RANDOM = frozenset(
  """random_bits random_wrap random_unwrap random_fold_in random_split
  random_seed threefry2x32""".split()
)
REDUCE = REDUCE_AXES | {"reduce_and", "reduce_or", "reduce_xor"}
CUMULATIVE = frozenset(
  {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
)
SMALL = 64  # fold constants of at most this many elements
SCATTERS = frozenset(
  {"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul"}
)
# the factors baked into examples' terms while one jaxpr is classified
BAKED: contextvars.ContextVar[list] = contextvars.ContextVar("baked")


def const(val) -> C:
  small = val if np.size(val) <= SMALL else None
  return C(frozenset() if small is None else _uniform_in(small), small)


def shape_of(v):
  return tuple(getattr(v.aval, "shape", ()))


def where(e) -> str:
  """`` at file:line`` of the user's code an equation came from, or ''."""
  frames = user_frames(e)
  return f" at {frames[0][0]}:{frames[0][1]}" if frames else ""


def user_frames(e) -> tuple:
  """``(file, line)`` of each frame of the user's code an equation was
  traced under, innermost first (library frames left out)."""
  try:
    frames = e.source_info.traceback.frames
  except AttributeError:
    return ()
  skip = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/zerojax/_src/")
  return tuple(
    (f.file_name, f.line_num)
    for f in frames
    if not any(s in f.file_name for s in skip)
  )


def fold(e, ins) -> C:
  """A constant's class; its value when every input's is known and small.
  An iota's axis is kept (elementwise with scalars too)."""
  out = e.outvars[0]
  shape = shape_of(out)
  if e.primitive.name == "iota":
    dim = e.params["dimension"]
    val = None
    if math.prod(shape) <= SMALL:
      line = np.arange(shape[dim], dtype=np.dtype(e.params["dtype"]))
      along = [-1 if a == dim else 1 for a in range(len(shape))]
      val = np.broadcast_to(line.reshape(along), shape)
    return C(frozenset(range(len(shape))) - {dim}, val, dim)
  noise = e.primitive.name in RANDOM or any(c.noise for c in ins)
  if noise:
    return C(noise=True)
  uniform = frozenset()
  pos = None
  if e.primitive.name in ELEMENTWISE:
    full = [c for v, c in zip(e.invars, ins) if len(shape_of(v)) == len(shape)]
    # an operand of size 1 along an axis is broadcast along it
    uniform = frozenset(range(len(shape))).intersection(
      *(
        c.uniform | {i for i, n in enumerate(shape_of(v)) if n == 1}
        for v, c in zip(e.invars, ins)
        if len(shape_of(v)) == len(shape)
      )
    )
    # an iota's position survives arithmetic with values uniform along it
    counted = {c.pos for c in full if c.pos is not None}
    if len(counted) == 1:
      (pos,) = counted
      if not all(c.pos == pos or pos in c.uniform for c in full):
        pos = None
  elif e.primitive.name == "broadcast_in_dim":
    uniform, pos = broadcast_uniform(e, ins[0])
  else:
    uniform = _kept_uniform(e, ins)
  if all(c.val is not None for c in ins) and math.prod(shape) <= SMALL:
    try:
      with jax.ensure_compile_time_eval():
        val = np.asarray(e.primitive.bind(*[c.val for c in ins], **e.params))
      return C(uniform | _uniform_in(val), val, pos)
    except Exception:  # noqa: BLE001 -- a value not folded is only unknown
      pass
  fill = _fill(e, ins) if len(uniform) == len(shape) else None
  if fill is not None and math.prod(shape) <= SMALL:
    val = np.full(shape, fill, np.dtype(e.outvars[0].aval.dtype))
    return C(frozenset(range(len(shape))), val, pos)
  return C(uniform, None, pos, fill=fill)


def element_value(c: C):
  """The value every element of ``c`` has, when known."""
  if c.val is not None and np.size(c.val) >= 1:
    flat = np.ravel(np.asarray(c.val))
    return flat[0] if np.all(flat == flat[0]) else None
  return c.fill


# layout changes and reductions whose result holds only the input's values
_SAME_VALUES = frozenset(
  {"broadcast_in_dim", "reshape", "slice", "squeeze", "transpose", "rev"}
  | {"concatenate", "copy", "copy_p", "dynamic_slice", "reduce_max"}
  | {"reduce_min"}
)


def _fill(e, ins):
  """The one value of every element of a constant made of constants the
  same everywhere (``jnp.ones((rows, n))``, its sum): large constants keep
  it where their elements are not kept."""
  name = e.primitive.name
  if (
    name in ELEMENTWISE or name == "convert_element_type"
  ) and not e.primitive.multiple_results:
    values = [element_value(c) for c in ins]
    if any(v is None for v in values):
      return None
    params = dict(e.params)
    try:
      with jax.ensure_compile_time_eval():
        out = e.primitive.bind(*[np.asarray(v) for v in values], **params)
      return np.asarray(out).reshape(())[()]
    except Exception:  # noqa: BLE001 -- a value not folded is only unknown
      return None
  if name in _SAME_VALUES:
    values = {element_value(c) for c in ins[:1]}
    if name == "concatenate":
      values = {element_value(c) for c in ins}
    return next(iter(values)) if len(values) == 1 else None
  if name == "reduce_sum":
    v = element_value(ins[0])
    before = shape_of(e.invars[0])
    n = math.prod(before[a] for a in e.params["axes"])
    return None if v is None else v * n
  return None


def _kept_uniform(e, ins) -> frozenset:
  """The axes of a constant's layout change along which it stays the same
  (a zero carry through a product, a transpose, a reduction)."""
  name, p = e.primitive.name, e.params
  u = ins[0].uniform if ins else frozenset()
  if name == "transpose":
    return frozenset(i for i, a in enumerate(p["permutation"]) if a in u)
  if name in REDUCE_AXES:
    axes = p["axes"]
    return frozenset(
      a - sum(1 for x in axes if x < a) for a in u if a not in axes
    )
  if name == "dot_general":
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    ua, ub = ins[0].uniform, ins[1].uniform
    ra, rb_rank = len(shape_of(e.invars[0])), len(shape_of(e.invars[1]))
    out = [a in ua and b in ub for a, b in zip(lb, rb)]
    out += [a in ua for a in range(ra) if a not in lc and a not in lb]
    out += [b in ub for b in range(rb_rank) if b not in rc and b not in rb]
    return frozenset(i for i, ok in enumerate(out) if ok)
  if name in (
    "reduce_precision",
    "copy",
    "copy_p",
    "convert_element_type",
    "slice",
    "dynamic_slice",
    "rev",
  ):
    return u  # the same along an axis: so is any part of it
  if name == "squeeze":
    gone = p["dimensions"]
    return frozenset(
      a - sum(1 for x in gone if x < a) for a in u if a not in gone
    )
  if name == "reshape" and p.get("dimensions") is None:
    return _reshape_uniform(shape_of(e.invars[0]), shape_of(e.outvars[0]), u)
  if name == "concatenate":
    return frozenset(u.intersection(*(c.uniform for c in ins))) - {
      p["dimension"]
    }
  if name in SCATTERS:
    return _scatter_uniform(e, ins)
  if name == "gather":
    return _gather_uniform(e, ins)
  if name == "tile":  # an axis of size 1 is repeated: the same along it
    before = shape_of(e.invars[0])
    return frozenset(a for a, n in enumerate(before) if a in u or n == 1)
  return frozenset()


def _reshape_uniform(before, after, u) -> frozenset:
  """A reshape that only adds or drops axes of size 1 keeps each axis's
  sameness; any axis of size 1 is the same along itself."""
  ones = {i for i, n in enumerate(after) if n == 1}
  a = [i for i, n in enumerate(before) if n != 1]
  b = [i for i, n in enumerate(after) if n != 1]
  if [before[i] for i in a] != [after[j] for j in b]:
    return frozenset(ones)
  return frozenset(ones | {j for i, j in zip(a, b) if i in u})


def _scatter_uniform(e, ins) -> frozenset:
  """A scatter into a constant (``x.at[:, 0].set(v)``) stays the same
  along an operand axis it neither indexes nor slices: the operand is
  uniform there and the update covers it whole and is uniform along it."""
  if e.primitive.name == "scatter" and not e.params.get("unique_indices"):
    return frozenset()  # which of two writes lands is not defined
  dn = e.params["dimension_numbers"]
  operand, updates = shape_of(e.invars[0]), shape_of(e.invars[2])
  skipped = set(dn.inserted_window_dims)
  skipped |= set(getattr(dn, "operand_batching_dims", ()))
  window = [a for a in range(len(operand)) if a not in skipped]
  kept = set()
  for a, ud in zip(window, dn.update_window_dims):
    if (
      a in ins[0].uniform
      and a not in dn.scatter_dims_to_operand_dims
      and updates[ud] == operand[a]
      and (ud in ins[2].uniform or updates[ud] == 1)
    ):
      kept.add(a)
  return frozenset(kept)


def _gather_uniform(e, ins) -> frozenset:
  """A lookup of a constant by constant indices (positions broadcast over
  the rows, looked up in a table) is the same along a batch axis of its
  indices that they are the same along (with the operand too, for a
  batching axis), and along a slice axis the operand is the same along."""
  dn = e.params["dimension_numbers"]
  operand, indices = ins[0], ins[1]
  offset = tuple(dn.offset_dims)
  out_rank = len(shape_of(e.outvars[0]))
  batch_out = [i for i in range(out_rank) if i not in offset]
  op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  kept = set()
  # the indices' last axis is the index vector; the others are the batch
  for a, out in enumerate(batch_out):
    paired = (
      a not in idx_batching
      or op_batching[idx_batching.index(a)] in operand.uniform
    )
    if a in indices.uniform and paired:
      kept.add(out)
  sliced = [
    a
    for a in range(len(shape_of(e.invars[0])))
    if a not in dn.collapsed_slice_dims and a not in op_batching
  ]
  kept |= {out for a, out in zip(sliced, offset) if a in operand.uniform}
  return frozenset(kept)


def _uniform_in(val) -> frozenset:
  """The axes along which a known value is the same."""
  return frozenset(
    a
    for a in range(np.ndim(val))
    if np.array_equal(val, np.take(val, [0] * np.shape(val)[a], axis=a))
  )


def broadcast_uniform(e, c: C):
  in_shape, out_shape = shape_of(e.invars[0]), shape_of(e.outvars[0])
  dims = e.params["broadcast_dimensions"]
  uniform = set(range(len(out_shape))) - set(dims)
  for i, d in enumerate(dims):
    if i in c.uniform or (in_shape[i] == 1 and out_shape[d] != 1):
      uniform.add(d)
  pos = None if c.pos is None else dims[c.pos]
  return frozenset(uniform), pos


def elementwise(e, name, ins):
  shape = shape_of(e.outvars[0])
  rank = len(shape)
  kinds = {type(c) for c in ins}
  if S in kinds:
    return linear(name, ins)
  rows = [c for c in ins if isinstance(c, (R, IX))]
  if any(isinstance(c, IX) for c in rows):
    raise Unknown("arithmetic on an index built from the rows")
  first = rows[0]
  if any(c.layout != first.layout for c in rows):
    if all(c.m == 1 for c in rows):  # rows on two axes: pairs of examples
      raise Mixes(f"{name} of every example with every other (a pair matrix)")
    raise Unknown(f"{name} of two differently laid out per-example values")
  for v, c in zip(e.invars, ins):
    if (
      isinstance(c, C)
      and len(shape_of(v)) == rank
      and first.d not in c.uniform
      and shape_of(v)[first.d] != 1  # size 1: broadcast along the rows
      and not c.noise
    ):
      if c.pos == first.d and first.m == 1:  # a device counts its own rows
        raise Mixes(f"{name} of each example with its position in the batch")
      if c.pos == first.d:
        raise Unknown(f"{name} of an example with its position in the batch")
      if c.val is not None and first.m == 1:  # known to differ over rows
        raise Mixes(
          f"{name} of each example with a constant that differs from row "
          f"to row (a weight by position in the batch)"
        )
      # (a constant the reading lost track of may well be the same for
      # every example)
      raise Unknown(f"{name} of an example with a value that varies over rows")
  return R(first.d, first.m, scaled(name, ins))


def scaled(name, ins) -> float:
  """The literal factor on the examples after ``name``: kept through
  linear steps (a product or quotient with a scalar, a sum of values scaled
  alike), recorded (:func:`bake`) and reset before anything else."""
  rows = [c for c in ins if isinstance(c, R)]
  if name in PASS or name == "neg":
    return rows[0].scale
  if name == "mul":
    k = 1.0
    for c in ins:
      k *= c.scale if isinstance(c, R) else scalar(c)
    return k
  if name == "div" and isinstance(ins[0], R):
    b = ins[1]
    return ins[0].scale / (b.scale if isinstance(b, R) else scalar(b))
  if name in ("add", "add_any", "sub") and len(rows) == len(ins):
    if all(c.scale == rows[0].scale for c in rows):
      return rows[0].scale
  for c in rows:
    bake(c.scale)
  return 1.0


def baked(c: R) -> R:
  bake(c.scale)
  return dataclasses.replace(c, scale=1.0)


def bake(scale: float):
  """A factor that now sits inside each example's term: it must be the
  same at every batch size (compared by :func:`verdict`)."""
  if scale != 1.0:
    BAKED.get().append(scale)


def linear(name, ins):
  """Elementwise with a batch sum among the operands."""
  if any(isinstance(c, (R, IX)) for c in ins):
    raise Mixes(
      f"{name} combines each example with a sum over the batch (batch "
      f"statistics, a normalization over the rows)"
    )
  sums = [c for c in ins if isinstance(c, S)]
  at = next((c.at for c in sums if c.at), "")
  consts = [c for c in ins if isinstance(c, C)]
  off = any(s.offset for s in sums)
  if name in ("add", "add_any", "sub"):
    off = off or any(nonzero(c) for c in consts)
    coefs = [
      -x if name == "sub" and i == 1 else x
      for i, c in enumerate(ins)
      if isinstance(c, S)
      for x in c.coefs
    ]
    return S(tuple(coefs), at, off)
  if name in PASS or name == "neg":
    (s,) = sums
    return S(tuple(-x for x in s.coefs), at, off) if name == "neg" else s
  if name == "mul":
    if len(sums) > 1:
      raise Mixes("a product of two sums over the batch")
    return S(tuple(x * scalar(consts[0]) for x in sums[0].coefs), at, off)
  if name == "div":
    a, b = ins
    if isinstance(b, S):
      raise Mixes(
        "a division by a sum over the batch (a mean normalized by a count "
        "over the rows, such as a token count)"
      )
    return S(tuple(x / scalar(b) for x in a.coefs), at, off)
  if name in NONLINEAR:
    raise Mixes(
      f"{name} of a sum over the batch (a nonlinear function of a mean)"
    )
  if name == "select_n" and isinstance(ins[0], C) and not ins[0].noise:
    # one case for every device and micro-batch (a guard on a count): a
    # sum, or a constant each adds once
    off = off or any(nonzero(c) for c in consts[1:])
    coefs = sorted({x for c in sums for x in c.coefs})
    return S(tuple(coefs), at, off)
  raise Unknown(f"{name} of a sum over the batch")


def nonzero(c: C) -> bool:
  """Whether constant ``c`` may differ from 0 (its value not known 0)."""
  v = element_value(c)
  return v is None or bool(np.any(v != 0))


def scalar(c: C) -> float:
  """A known factor (every element alike), or 1.0 for one that does not
  depend on the batch's rows (a param, a scalar batch leaf: it scales
  every trace alike) or is compared between traces (``row_count``)."""
  v = element_value(c)
  return 1.0 if v is None else float(np.real(v))
