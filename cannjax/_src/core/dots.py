"""The dot-form table: how each platform multiplies half-precision matrices.

Every matrix product of cannjax's operators goes through :func:`dot_general`. Wide
operands (float32, float64) are multiplied as they are. Half-precision operands
(bfloat16, float16) take the *form* that the lowering platform's entry of this table
names:

* ``"half"``: the half operands go to the product as they are, accumulated in float32
  (``preferred_element_type=float32``), and the result is rounded once to the requested
  dtype. This is the form matrix units run (GPU tensor cores, TPU MXUs, x86's AVX512-BF16
  and AMX, Arm's BF16 extension): on XLA:CPU a ``bf16 x bf16 -> f32`` product with the
  contraction on the operands' last axes runs 2x (AVX512-BF16) to 6x (AMX) faster than
  float32, where a ``bf16 -> bf16`` product is *upcast* by XLA and runs below float32
  speed (``benchmarks/dot_forms.py`` measures each form).
* ``"float32"``: the operands are converted to float32 first and the product is a
  float32 one: the fallback of a platform without fast half-precision products (a CPU
  without BF16 instructions; float16 on every CPU), where the ``"half"`` form would run
  the same conversions slower inside the matrix kernel.

A product whose left operand is contracted on another axis than its last (the weight
gradient ``x^T g``, contracting the token axis; attention's ``p^T do``) is one more
choice, the entry's ``transpose`` flag. XLA:CPU runs a half product on its matrix
kernel (YNNPACK) only when the left operand is contracted on its last axis and every
operand is row-major, and it decides so *before* it assigns layouts: a transposed
operand written as ``x.T`` is a column-major view by then, and the product is upcast to
float32. With ``transpose=True`` such a product transposes its operand into a row-major
copy first (``jax.experimental.layout.with_layout_constraint``, opaque until layout
assignment) and constrains the product's result likewise (without it XLA folds a later
transpose of the result into a product its kernels cannot run). The copy costs one pass
over the smaller operand.

The entry of the host CPU is read off its instruction set when first asked; other
platforms default to ``"half"`` without transposes. The choice is made when the
program is *lowered*, as the kernel table's is (:mod:`cannjax._src.core.kernels`):
with different forms on different platforms a product is staged out as
``lax.platform_dependent`` over them; with one form for all it is traced directly,
with no conditional.

Example:
  >>> import jax.numpy as jnp
  >>> from cannjax._src.core import dots
  >>> a = jnp.ones((4, 8), jnp.bfloat16)
  >>> dots.dot_general(a, a, (((1,), (1,)), ((), ()))).dtype  # the operands' dtype
  dtype(bfloat16)
  >>> dots.dot_general(a, a, (((1,), (1,)), ((), ())), out_dtype=jnp.float32).dtype
  dtype('float32')
"""

from __future__ import annotations

import dataclasses
import functools
import platform as _host
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

FORMS = ("half", "float32")
HALF_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class DotForm:
    """One platform's way of multiplying matrices of one half-precision dtype.

    Attributes:
      platform: the lowering platform (``"cpu"``, ``"cuda"``, ``"ascend"``...).
      dtype: ``"bfloat16"`` or ``"float16"``.
      form: ``"half"`` (half operands, float32 accumulation) or ``"float32"``
        (operands converted to float32 first).
      transpose: in the ``"half"`` form, give a product whose left operand is contracted
        on another axis than its last a row-major transposed copy of that operand.
      source: why this form, for reports (``"host CPU has avx512_bf16"``).
    """

    platform: str
    dtype: str
    form: str
    transpose: bool = False
    source: str = ""


# (platform, dtype name) -> DotForm; the host CPU's entries are added when first read.
_TABLE: dict[tuple[str, str], DotForm] = {}
# Bumped on every change: part of the operators' rule cache key (kernels.generation).
_GENERATION = [0]

# /proc/cpuinfo flags that give XLA:CPU a fast bf16 x bf16 -> f32 product.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def host_cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the host CPU (``/proc/cpuinfo``; empty if unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _host_cpu_forms() -> dict[tuple[str, str], DotForm]:
    flags = host_cpu_flags()
    found = [f for f in _BF16_FLAGS if f in flags]
    if found:
        bf16 = DotForm("cpu", "bfloat16", "half", True, f"host CPU has {', '.join(found)}")
    else:
        bf16 = DotForm(
            "cpu",
            "bfloat16",
            "float32",
            source=f"host CPU ({_host.machine()}) lacks {'/'.join(_BF16_FLAGS)}: XLA would convert",
        )
    f16 = DotForm("cpu", "float16", "float32", source="XLA:CPU has no fast float16 product")
    return {("cpu", "bfloat16"): bf16, ("cpu", "float16"): f16}


@functools.cache
def _host_read() -> None:
    for key, entry in _host_cpu_forms().items():
        _TABLE.setdefault(key, entry)


def _dtype_name(fn: str, dtype: Any) -> str:
    name = jnp.dtype(dtype).name
    if name not in HALF_DTYPES:
        raise ValueError(f"{fn}: dtype must be one of {HALF_DTYPES}, got {name!r}")
    return name


def register_dot_form(
    platform: str,
    dtype: Any,
    form: str,
    *,
    transpose: bool = False,
    source: str = "",
    overwrite: bool = True,
) -> DotForm:
    """Sets how ``platform`` multiplies matrices of the half-precision ``dtype``.

    Args:
      platform: lowering platform name, e.g. ``"cpu"``, ``"cuda"``, ``"ascend"``.
      dtype: ``jnp.bfloat16`` or ``jnp.float16`` (or their names).
      form: ``"half"`` or ``"float32"`` (see the module docstring).
      transpose: whether a ``"half"`` product contracting its left operand on another
        axis than its last transposes that operand first (the module docstring).
      source: why, for reports.
      overwrite: replace an existing entry (the default: the host CPU's entry is a
        guess from its flags that a measurement may correct).

    Returns:
      The registered :class:`DotForm`.

    Raises:
      ValueError: an unknown form or dtype, a bad platform name, or an existing entry
        with ``overwrite=False``.
      TypeError: ``transpose`` not a bool.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.core import dot_form, register_dot_form
      >>> old = dot_form("cuda", jnp.bfloat16)
      >>> register_dot_form("cuda", jnp.bfloat16, "float32").form
      'float32'
      >>> _ = register_dot_form("cuda", jnp.bfloat16, old.form, source=old.source)
    """
    from cannjax._src.core.kernels import _check_platform

    fn = "cannjax.core.register_dot_form"
    platform = _check_platform(fn, platform)
    name = _dtype_name(fn, dtype)
    if form not in FORMS:
        raise ValueError(f"{fn}: form must be one of {FORMS}, got {form!r}")
    if not isinstance(transpose, bool):
        raise TypeError(f"{fn}: transpose must be a bool, got {transpose!r}")
    _host_read()
    if (platform, name) in _TABLE and not overwrite:
        raise ValueError(f"{fn}: ({platform!r}, {name!r}) has an entry; pass overwrite=True")
    entry = DotForm(platform, name, form, transpose, source)
    _TABLE[(platform, name)] = entry
    _GENERATION[0] += 1
    return entry


def dot_form(platform: str, dtype: Any) -> DotForm:
    """The :class:`DotForm` of ``platform`` for ``dtype`` (``"half"`` when unregistered)."""
    fn = "cannjax.core.dot_form"
    name = _dtype_name(fn, dtype)
    _host_read()
    return _TABLE.get((platform, name), DotForm(platform, name, "half", source="default"))


def dot_form_table() -> Mapping[tuple[str, str], DotForm]:
    """A snapshot of the table: ``(platform, dtype name) -> DotForm``."""
    _host_read()
    return dict(sorted(_TABLE.items()))


def generation() -> int:
    """How many times the table changed (a cache key for traced rules)."""
    return _GENERATION[0]


def _half(a, b, dims, out):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out)


def _wide(a, b, dims, out):
    f32 = jnp.float32
    return lax.dot_general(a.astype(f32), b.astype(f32), dims).astype(out)


def row_major(a: jax.Array) -> jax.Array:
    """``a`` in a row-major layout, fixed before XLA's layout assignment."""
    return with_layout_constraint(a, Layout(major_to_minor=tuple(range(a.ndim))))


def _transposable(a_ndim: int, dims) -> bool:
    """Whether a product contracts its left operand on one axis other than its last,
    with leading batch axes (what the ``transpose`` flag rewrites)."""
    (ca, _), (ba, bb) = dims
    lead = tuple(range(len(ba)))
    return len(ca) == 1 and ca[0] != a_ndim - 1 and tuple(ba) == lead == tuple(bb)


def _half_transposed(a, b, dims, out):
    """:func:`_half` with ``a``'s contracted axis moved last in a row-major copy."""
    (ca, cb), batch = dims
    last = a.ndim - 1
    a = row_major(jnp.moveaxis(a, ca[0], -1))  # the free axes keep their order
    y = lax.dot_general(a, b, (((last,), cb), batch), preferred_element_type=jnp.float32)
    return row_major(y.astype(out))


def _rule(entry: str | tuple[str, bool], a_ndim: int, dims):
    form, transpose = entry if isinstance(entry, tuple) else (entry, False)
    if form == "float32":
        return _wide
    return _half_transposed if transpose and _transposable(a_ndim, dims) else _half


def dot_general(
    a: jax.Array, b: jax.Array, dimension_numbers: Any, *, out_dtype: Any = None
) -> jax.Array:
    """``lax.dot_general(a, b, dimension_numbers)`` in the platform's dot form.

    Args:
      a, b: floating operands (promoted to their common dtype).
      dimension_numbers: as ``lax.dot_general``'s.
      out_dtype: the result's dtype (default: the operands'). With half operands the
        product is accumulated in float32 in every form and rounded once to it.

    Returns:
      The product, of ``out_dtype``.
    """
    dt = jnp.result_type(a, b)
    out = jnp.dtype(out_dtype) if out_dtype is not None else dt
    a, b = a.astype(dt), b.astype(dt)
    if dt.name not in HALF_DTYPES:
        acc = out if jnp.dtype(out).itemsize > dt.itemsize else None
        y = lax.dot_general(a, b, dimension_numbers, preferred_element_type=acc)
        return y.astype(out)
    _host_read()
    rules = {
        p: _rule((e.form, e.transpose), a.ndim, dimension_numbers)
        for (p, n), e in _TABLE.items()
        if n == dt.name
    }
    # Unregistered platforms take "half"; one rule for all is traced directly.
    if set(rules.values()) <= {_half}:
        return _half(a, b, dimension_numbers, out)
    branches = {
        p: functools.partial(r, dims=dimension_numbers, out=out)
        for p, r in rules.items()
        if r is not _half
    }
    default = functools.partial(_half, dims=dimension_numbers, out=out)
    return lax.platform_dependent(a, b, default=default, **branches)


def weight_grad(x2: jax.Array, g2: jax.Array, *, out_dtype: Any = None) -> jax.Array:
    """``x2^T @ g2`` for ``x2 [N, K]``, ``g2 [N, P]``: a weight gradient, in the dot form.

    One product contracting the rows of both operands, the form plain autodiff emits
    (see :func:`cannjax.ops.linear`'s rules for why it is kept in float32). Where the
    platform transposes half operands (the module docstring) the smaller one is
    transposed: with ``P < K`` the product is ``(g2^T x2)^T``, whose result transpose is
    weight-sized.
    """
    rows = (((0,), (0,)), ((), ()))
    k, p = x2.shape[1], g2.shape[1]
    if p < k and _transposes(jnp.result_type(x2, g2)):
        return row_major(dot_general(g2, x2, rows, out_dtype=out_dtype).T)
    return dot_general(x2, g2, rows, out_dtype=out_dtype)


def _transposes(dtype) -> bool:
    """Whether any platform's entry transposes operands of ``dtype``."""
    if jnp.dtype(dtype).name not in HALF_DTYPES:
        return False
    _host_read()
    return any(e.transpose for (_, n), e in _TABLE.items() if n == jnp.dtype(dtype).name)


def matmul(a: jax.Array, b: jax.Array, *, out_dtype: Any = None) -> jax.Array:
    """``a @ b`` for ``a [N, K]``, ``b [K, P]`` in the dot form ("NN")."""
    return dot_general(a, b, (((1,), (0,)), ((), ())), out_dtype=out_dtype)


def matmul_t(a: jax.Array, b: jax.Array, *, out_dtype: Any = None) -> jax.Array:
    """``a @ b^T`` for ``a [N, P]``, ``b [K, P]`` ("NT": both contracted on their last
    axis), never through a transposed copy of ``b`` (XLA runs a half product with a
    transposed operand in float32)."""
    return dot_general(a, b, (((1,), (1,)), ((), ())), out_dtype=out_dtype)
