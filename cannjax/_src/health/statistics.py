"""Per-leaf gradient statistics, computed inside ``jit``: :func:`grad_stats`.

For every gradient leaf (named by its pytree path): the L2 norm, ``max |g|``, the
fraction of exact zeros, the NaN and Inf counts, and the global norm
``sqrt(sum_leaves ||g||^2)``. The result is a small pytree (:class:`GradStats`: five
``[L]`` vectors and a scalar, ``L`` leaves), so it leaves the device in one transfer; it
renders as a text table (``str``) and as HTML in Jupyter (``_repr_html_``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cannjax._src.core.tables import number, render, render_html

FIELDS = ("norm", "max_abs", "zero_frac", "nan_count", "inf_count")
"""The per-leaf fields of :class:`GradStats`, in table order."""
HEADERS = ("norm", "max|g|", "zeros", "NaN", "Inf")
"""The column titles of :data:`FIELDS` in the tables."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GradStats:
    """Per-leaf gradient statistics (a pytree; every array field survives ``jit``).

    Attributes:
      norm: ``[L]`` float32, L2 norm of each leaf (accumulated in float32).
      max_abs: ``[L]`` float32, ``max |g|`` of each leaf (NaN if the leaf has a NaN).
      zero_frac: ``[L]`` float32, fraction of entries exactly 0.
      nan_count: ``[L]`` int32, number of NaN entries.
      inf_count: ``[L]`` int32, number of +-Inf entries.
      global_norm: ``[]`` float32, ``sqrt(sum(norm**2))``.
      paths: static: the pytree path of each leaf (``jax.tree_util.keystr``).
    """

    norm: jax.Array
    max_abs: jax.Array
    zero_frac: jax.Array
    nan_count: jax.Array
    inf_count: jax.Array
    global_norm: jax.Array
    paths: tuple[str, ...] = dataclasses.field(metadata={"static": True})

    @property
    def finite(self) -> bool:
        """Whether no leaf has a NaN or Inf (host side)."""
        return int(np.sum(self.nan_count)) + int(np.sum(self.inf_count)) == 0

    def rows(self) -> list[dict]:
        """One dict per leaf (host side): path, norm, max_abs, zero_frac, nan, inf."""
        cols = [np.asarray(getattr(self, k)) for k in FIELDS]
        return [
            {"path": p, **{k: c[i].item() for k, c in zip(FIELDS, cols)}}
            for i, p in enumerate(self.paths)
        ]

    def _cells(self) -> list[list[str]]:
        return [[r["path"], *(number(r[k]) for k in FIELDS)] for r in self.rows()]

    def table(self) -> str:
        """A text table, one row per leaf, then the global norm."""
        text = render(["leaf", *HEADERS], self._cells(), grid=True)
        return f"{text}\nglobal norm {number(float(self.global_norm))}"

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        """One line: ``GradStats(3 leaves: global norm 2.5000, NaN/Inf in ['w'])``."""
        n = f"{len(self.paths)} leaves"
        if isinstance(self.global_norm, jax.core.Tracer):  # printed while tracing
            return f"GradStats({n}, traced)"
        if np.ndim(self.norm) != 1:  # stacked by vmap or over steps
            return f"GradStats({n}, stacked {np.shape(self.norm)})"
        bad = [r["path"] for r in self.rows() if r["nan_count"] + r["inf_count"]]
        state = f"NaN/Inf in {', '.join(bad[:3])}" if bad else "finite"
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return f"GradStats({n}: global norm {number(float(self.global_norm))}, {state}{more})"

    def _repr_html_(self) -> str:
        caption = f"gradient statistics, global norm {number(float(self.global_norm))}"
        nan, inf = np.asarray(self.nan_count), np.asarray(self.inf_count)
        bad = {i for i in range(len(self.paths)) if nan[i] + inf[i] > 0}
        return render_html(["leaf", *HEADERS], self._cells(), caption, marked=bad)


def grad_stats(grads: Any) -> GradStats:
    """Per-leaf gradient statistics and the global norm; traceable (use inside ``jit``).

    For each floating leaf ``g`` (``n`` entries; the first three in one pass, the counts
    only when the sum of squares is not finite)::

        norm      = sqrt(sum(g**2))          (float32 accumulation)
        max_abs   = max |g|
        zero_frac = #{g == 0} / n
        nan_count = #{isnan(g)},  inf_count = #{isinf(g)}
        global    = sqrt(sum over leaves of norm**2)

    Non-floating leaves (integer state, ``float0`` gradients) are skipped. A norm above
    ~1.8e19 overflows float32 to ``inf`` with ``inf_count == 0``: that is an exploding
    gradient, and the monitor flags it so.

    Args:
      grads: a pytree of arrays (gradients, updates, or any parameters).

    Returns:
      A :class:`GradStats` pytree.

    Raises:
      TypeError: ``grads`` has no floating leaf.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.health import grad_stats
      >>> s = jax.jit(grad_stats)({"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])})
      >>> s.paths, float(s.global_norm), [float(z) for z in s.zero_frac]
      (("['b']", "['w']"), 5.0, [0.0, 0.5])
    """
    leaves = [
        (jax.tree_util.keystr(path) or "<root>", jnp.asarray(x))
        for path, x in jax.tree_util.tree_leaves_with_path(grads)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if not leaves:
        raise TypeError(
            "cannjax.health.grad_stats: grads has no floating-point leaf (got the pytree "
            f"{jax.tree.structure(grads)}); pass the gradients, e.g. jax.grad(loss)(params)"
        )
    cols: dict[str, list] = {k: [] for k in FIELDS}
    sq = []
    for _, g in leaves:
        s, mx, zeros, nan, inf = _leaf_stats(g)
        sq.append(s)
        cols["norm"].append(jnp.sqrt(s))
        cols["max_abs"].append(mx)
        cols["zero_frac"].append(zeros.astype(jnp.float32) / max(g.size, 1))
        cols["nan_count"].append(nan)
        cols["inf_count"].append(inf)
    return GradStats(
        **{k: jnp.stack(v) for k, v in cols.items()},
        global_norm=jnp.sqrt(jnp.sum(jnp.stack(sq))),
        paths=tuple(p for p, _ in leaves),
    )


def _leaf_stats(g: jax.Array) -> tuple[jax.Array, ...]:
    # One variadic reduction gives sum g^2, max |g| and the zero count in one pass. NaN and
    # Inf counts need passes of their own, but a finite sum of squares proves there are
    # none, so they run only when it is not (the rare, interesting case).
    g32 = g.astype(jnp.float32)

    def combine(a, b):
        return a[0] + b[0], jnp.maximum(a[1], b[1]), a[2] + b[2]

    init = (jnp.float32(0), jnp.float32(0), jnp.int32(0))
    ops = (g32 * g32, jnp.abs(g32), (g == 0).astype(jnp.int32))
    sq, mx, zeros = jax.lax.reduce(ops, init, combine, tuple(range(g.ndim)))

    def counts(_):
        return jnp.sum(jnp.isnan(g), dtype=jnp.int32), jnp.sum(jnp.isinf(g), dtype=jnp.int32)

    none = (jnp.int32(0), jnp.int32(0))
    nan, inf = jax.lax.cond(jnp.isfinite(sq), lambda _: none, counts, None)
    return sq, mx, zeros, nan, inf
