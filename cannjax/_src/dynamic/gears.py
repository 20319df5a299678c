"""Gears: a few sequence lengths compiled ahead, every batch padded to the nearest.

JAX compiles a program per input shape. A training loop whose batches vary in length
either recompiles for each new length or pads every batch to one length and wastes the
compute spent on padding. CANN's model compiler answers with *gears*: a handful of shapes
chosen ahead, each compiled once, every input padded up to the smallest gear that holds
it. With ``k`` gears there are at most ``k`` compiles; what is left to choose is the sizes,
and :func:`plan_gears` chooses them to minimize the expected cost of the padded work,

.. math::  \\min_{S,\\ |S| \\le k} \\ \\sum_i c_i \\, \\mathrm{cost}(\\mathrm{gear}_S(x_i)),
   \\qquad \\mathrm{gear}_S(x) = \\min \\{ s \\in S : s \\ge x \\},

over the observed lengths ``x_i`` (``c_i`` times each), exactly, by dynamic programming.
:func:`power_of_two_gears` is the usual baseline and :func:`fixed_gears` evaluates any
sizes on a distribution; all three return a :class:`Gears`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from cannjax._src.core.platform import facts
from cannjax._src.core.tables import number, render, render_html

_FN = "cannjax.dynamic"

COST_MODELS: dict[str, Callable[[int], float]] = {
    "linear": lambda n: float(n),  # dense layers: work proportional to the length
    "quadratic": lambda n: float(n) * float(n),  # attention scores: T x T
}


@dataclasses.dataclass(frozen=True)
class Gears:
    """A set of gear sizes and what they cost on a distribution of lengths.

    Build one with :func:`plan_gears`, :func:`power_of_two_gears` or :func:`fixed_gears`;
    pass it to :func:`cannjax.dynamic.geared`. A length ``x`` runs in the smallest gear
    ``>= x`` (:meth:`gear_for`).

    Attributes:
      sizes: the gear sizes, increasing.
      counts: how many of the lengths planned for fall in each gear.
      padded_costs: per gear, the sum of ``cost(gear)`` over its lengths.
      unpadded_costs: per gear, the sum of ``cost(length)`` over its lengths.
      cost: the cost model's name (``"linear"``, ``"quadratic"``, or the callable's).
      multiple: the gear sizes are multiples of it (1: any size), except a top gear cut
        to ``max_length``; a gear added on overflow by ``geared`` is rounded up to it.

    Example:
      >>> from cannjax.dynamic import fixed_gears
      >>> g = fixed_gears([8, 16], [3, 8, 9, 16])
      >>> g.counts, g.expected_cost, round(g.overhead, 4)
      ((2, 2), 12.0, 0.3333)
      >>> g.gear_for(5), g.gear_for(16)
      (8, 16)
    """

    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    padded_costs: tuple[float, ...]
    unpadded_costs: tuple[float, ...]
    cost: str = "linear"
    multiple: int = 1

    def __post_init__(self):
        n = len(self.sizes)
        if n == 0 or any(s <= 0 for s in self.sizes) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(
                f"{_FN}.Gears: sizes must be positive and strictly increasing, got {self.sizes}"
            )
        for f in ("counts", "padded_costs", "unpadded_costs"):
            if len(getattr(self, f)) != n:
                raise ValueError(
                    f"{_FN}.Gears: {f} must have one entry per gear ({n}), got {getattr(self, f)}"
                )

    @property
    def expected_cost(self) -> float:
        """The mean padded cost per length: ``sum(padded_costs) / sum(counts)``."""
        return math.fsum(self.padded_costs) / max(sum(self.counts), 1)

    @property
    def overhead(self) -> float:
        """The padded cost over the unpadded cost, minus one (0: no padding at all)."""
        unpadded = math.fsum(self.unpadded_costs)
        return math.fsum(self.padded_costs) / unpadded - 1 if unpadded else 0.0

    def gear_for(self, length: int) -> int:
        """The smallest gear that holds ``length``.

        Args:
          length: a sequence length, a positive int.

        Returns:
          The smallest size in :attr:`sizes` that is ``>= length``.

        Raises:
          TypeError: if ``length`` is not an int.
          ValueError: if ``length < 1``, or if it exceeds the largest gear.

        Example:
          >>> from cannjax.dynamic import fixed_gears
          >>> fixed_gears([32, 64], [20, 50]).gear_for(33)
          64
        """
        fn = f"{_FN}.Gears.gear_for"
        if not _is_int(length):
            raise TypeError(f"{fn}: length must be an int, got {length!r}")
        if length < 1:
            raise ValueError(f"{fn}: length must be >= 1, got {length}")
        i = int(np.searchsorted(self.sizes, length))
        if i == len(self.sizes):
            raise ValueError(
                f"{fn}: length {length} exceeds the largest gear {self.sizes[-1]}; plan the "
                f"gears with max_length >= {length}, or wrap the step with "
                "cannjax.dynamic.geared(..., on_overflow='new_gear')"
            )
        return self.sizes[i]

    def _table(self) -> tuple[list[str], list[list[str]], str]:
        rows, low = [], 1
        for s, c, p, u in zip(self.sizes, self.counts, self.padded_costs, self.unpadded_costs):
            over = number(p / u - 1) if u else "-"
            rows.append([str(s), f"{low}-{s}", str(c), over])
            low = s + 1
        caption = (
            f"Gears: {len(self.sizes)} sizes for {sum(self.counts)} lengths, {self.cost} cost, "
            f"overhead {number(self.overhead)}"
        )
        return ["gear", "lengths", "count", "overhead"], rows, caption

    def __str__(self) -> str:
        headers, rows, caption = self._table()
        return caption + "\n" + render(headers, rows, right=(0, 2, 3))

    def __repr__(self) -> str:
        """The table ``print`` shows: a REPL shows the report, not its fields."""
        return str(self)

    def _repr_html_(self) -> str:
        headers, rows, caption = self._table()
        return render_html(headers, rows, caption, right=(0, 2, 3))


def plan_gears(
    lengths: Sequence[int] | Mapping[int, int],
    k: int,
    *,
    cost: str | Callable[[int], float] = "linear",
    multiple: int | str | None = None,
    max_length: int | None = None,
) -> Gears:
    """At most ``k`` gear sizes that minimize the expected padded cost of ``lengths``.

    Every length ``x`` is padded to its gear, the smallest size ``>= x``; the plan
    minimizes ``sum_x count(x) * cost(gear(x))`` over all sets of at most ``k`` sizes
    (multiples of ``multiple``, the largest covering the largest length). It is exact:

    Let ``x_1 < ... < x_n`` be the distinct lengths, ``C_j`` the count of those ``<= x_j``
    and ``r(x)`` the least allowed size ``>= x`` (``x`` rounded up to ``multiple``, at
    most ``max_length``). Take any allowed sizes: the lengths a size serves are a run
    ``x_{i+1} .. x_j`` of the sorted lengths, and lowering that size to ``r(x_j)`` keeps
    every length in it and, ``cost`` being nondecreasing, costs no more. So an optimal
    plan is a partition of the sorted lengths into at most ``k`` runs, each padded to
    ``r`` of its largest length, and the least cost ``F_g(j)`` of serving
    ``x_1 .. x_j`` with ``g`` runs obeys (the last run is ``x_{i+1} .. x_j``, the rest
    is served optimally)::

      F_0(0) = 0,   F_0(j) = inf for j > 0,
      F_g(j) = min_{i < j}  F_{g-1}(i) + (C_j - C_i) * cost(r(x_j)),

    and the answer is ``min_{g <= k} F_g(n)``, found in ``O(k n^2)`` time and ``O(k n)``
    memory, the runs read back from the minimizing ``i`` (lengths with the same ``r``
    are merged first: one run ending at the larger serves both at no more cost). With
    ``max_length`` the top gear is ``max_length`` itself (a zero-count length there ends
    the last run), so any later length up to it finds a gear.

    Args:
      lengths: the observed lengths, a sequence of positive ints (one per batch, say),
        or a histogram ``{length: count}`` with non-negative int counts.
      k: the most gears (compiled programs) allowed, ``>= 1``.
      cost: the cost of running length ``L``: ``"linear"`` (``L``: dense layers),
        ``"quadratic"`` (``L**2``: attention scores), or a callable ``L -> float``,
        finite, non-negative and nondecreasing (say ``lambda L: 12 * d * L + 2 * L**2``,
        proportional to the multiply-adds of a transformer layer of width ``d``).
      multiple: round gear sizes up to a multiple of this int; ``"platform"`` for the
        matmul multiple of the default backend's platform facts (16 on Ascend, 1
        elsewhere: ``cannjax.backend.facts().matmul_multiple``); None for any size.
      max_length: the largest gear (the model's longest sequence, say); lengths beyond
        it are refused. None: the largest length, rounded up to ``multiple``.

    Returns:
      The optimal :class:`Gears` (fewer than ``k`` when fewer suffice), with its
      ``expected_cost`` and ``overhead`` on ``lengths``.

    Raises:
      TypeError: ``lengths`` not a sequence or mapping, ``k``, ``multiple`` or
        ``max_length`` not ints, ``cost`` neither a name nor a callable.
      ValueError: empty ``lengths``, a length that is not a positive int, a negative or
        non-integer count, ``k < 1``, an unknown cost name, a cost that is negative, not
        finite or decreasing, ``multiple < 1``, or a length above ``max_length``.

    Example:
      >>> from cannjax.dynamic import plan_gears
      >>> g = plan_gears({10: 50, 12: 30, 60: 15, 64: 5}, k=2)
      >>> g.sizes, g.counts
      ((12, 64), (80, 20))
      >>> print(g)
      Gears: 2 sizes for 100 lengths, linear cost, overhead 0.0769
      gear  lengths  count  overhead
      ----  -------  -----  --------
        12  1-12        80    0.1163
        64  13-64       20    0.0492
      >>> plan_gears([10, 12, 60, 64], k=2, multiple=16).sizes
      (16, 64)
    """
    fn = f"{_FN}.plan_gears"
    xs, cs = _histogram(fn, lengths)
    k = _positive_int(fn, "k", k)
    m = _multiple(fn, multiple)
    cost_fn, cost_name = _cost_model(fn, cost)
    if max_length is not None:
        max_length = _positive_int(fn, "max_length", max_length)
        _check_fits(fn, xs, max_length, "max_length")
        if xs[-1] < max_length:  # a zero-count length: the last run ends at max_length
            xs, cs = np.append(xs, max_length), np.append(cs, 0)

    def r(x):
        s = -(-int(x) // m) * m
        return s if max_length is None else min(s, max_length)

    # Lengths with the same r(x) are served alike by every plan that ends a run at the
    # larger of them, and some optimal plan does: merge them, so n counts rounded sizes.
    sizes_r, which = np.unique([r(x) for x in xs], return_inverse=True)
    counts_r = np.zeros(len(sizes_r), np.int64)
    np.add.at(counts_r, which, cs)
    unit = _costs(fn, cost_fn, sizes_r)  # cost(r(x_j)), j = 1 .. n
    n = len(sizes_r)
    prefix = np.concatenate([[0], np.cumsum(counts_r)]).astype(np.float64)  # C_0 .. C_n

    f = np.full(n + 1, np.inf)  # F_{g-1}(0 .. n)
    f[0] = 0.0
    choices = []  # choices[g - 1][j]: the minimizing i of F_g(j)
    best, best_g = np.inf, 0
    for g in range(1, min(k, n) + 1):
        new, arg = np.full(n + 1, np.inf), np.zeros(n + 1, np.int64)
        for j in range(1, n + 1):
            cand = f[:j] + (prefix[j] - prefix[:j]) * unit[j - 1]  # i = 0 .. j-1
            arg[j] = int(np.argmin(cand))
            new[j] = cand[arg[j]]
        f = new
        choices.append(arg)
        if f[n] < best:
            best, best_g = f[n], g

    ends, j = [], n  # read the runs back: each run ends at x_j, the one before at i
    for g in range(best_g, 0, -1):
        ends.append(j)
        j = int(choices[g - 1][j])
    sizes = sorted(int(sizes_r[e - 1]) for e in ends)
    return _evaluate(fn, xs, cs, sizes, cost_fn, cost_name, m)


def power_of_two_gears(
    lengths: Sequence[int] | Mapping[int, int],
    k: int,
    *,
    cost: str | Callable[[int], float] = "linear",
) -> Gears:
    """The baseline: the ``k`` largest powers of two up to the one that holds every length.

    The top gear is the least power of two ``>=`` the largest length, and each gear
    below is half the one above; gears smaller than the least power of two ``>=`` the
    smallest length are dropped, as no length would use them (so fewer than ``k`` come
    back when the lengths span fewer octaves).

    Args:
      lengths: as for :func:`plan_gears`: a sequence of positive ints or a histogram
        ``{length: count}``.
      k: the most gears, ``>= 1``.
      cost: as for :func:`plan_gears`.

    Returns:
      The :class:`Gears`, with their cost on ``lengths``.

    Raises:
      TypeError: as for :func:`plan_gears`.
      ValueError: as for :func:`plan_gears`.

    Example:
      >>> from cannjax.dynamic import plan_gears, power_of_two_gears
      >>> lengths = {10: 50, 12: 30, 60: 15, 64: 5}
      >>> power_of_two_gears(lengths, k=3).sizes
      (16, 32, 64)
      >>> p2, dp = power_of_two_gears(lengths, k=2), plan_gears(lengths, k=2)
      >>> p2.sizes, round(p2.overhead, 4), dp.sizes, round(dp.overhead, 4)
      ((32, 64), 0.8462, (12, 64), 0.0769)
    """
    fn = f"{_FN}.power_of_two_gears"
    xs, cs = _histogram(fn, lengths)
    k = _positive_int(fn, "k", k)
    cost_fn, cost_name = _cost_model(fn, cost)
    top = 1 << (int(xs[-1]) - 1).bit_length()
    low = 1 << (int(xs[0]) - 1).bit_length()
    sizes = [top >> i for i in range(k) if top >> i >= low]
    return _evaluate(fn, xs, cs, sorted(sizes), cost_fn, cost_name, 1)


def fixed_gears(
    sizes: Sequence[int],
    lengths: Sequence[int] | Mapping[int, int],
    *,
    cost: str | Callable[[int], float] = "linear",
) -> Gears:
    """The given gear sizes, with their cost on ``lengths``.

    For comparing any bucketing with a plan: ``fixed_gears([512], lengths).overhead`` is
    the waste of padding everything to 512.

    Args:
      sizes: the gear sizes, positive ints (sorted and deduplicated here).
      lengths: as for :func:`plan_gears`.
      cost: as for :func:`plan_gears`.

    Returns:
      The :class:`Gears`.

    Raises:
      TypeError: as for :func:`plan_gears`; ``sizes`` not a sequence.
      ValueError: as for :func:`plan_gears`; empty ``sizes`` or a size that is not a
        positive int; a length above the largest size.

    Example:
      >>> from cannjax.dynamic import fixed_gears
      >>> g = fixed_gears([64], {10: 50, 12: 30, 60: 15, 64: 5})
      >>> g.sizes, round(g.overhead, 4)
      ((64,), 2.0769)
    """
    fn = f"{_FN}.fixed_gears"
    sz, _ = _histogram(fn, sizes, arg="sizes")
    xs, cs = _histogram(fn, lengths)
    cost_fn, cost_name = _cost_model(fn, cost)
    _check_fits(fn, xs, int(sz[-1]), "the largest of sizes")
    return _evaluate(fn, xs, cs, [int(s) for s in sz], cost_fn, cost_name, 1)


def _evaluate(fn, xs, cs, sizes, cost_fn, cost_name, multiple) -> Gears:
    """The :class:`Gears` of ``sizes`` on the histogram ``(xs, cs)``."""
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    which = np.searchsorted(sizes_arr, xs)  # each length's gear: the first size >= it
    padded = cs * _costs(fn, cost_fn, sizes_arr)[which]
    unpadded = cs * _costs(fn, cost_fn, xs)
    per = [which == g for g in range(len(sizes))]
    return Gears(
        sizes=tuple(int(s) for s in sizes),
        counts=tuple(int(cs[p].sum()) for p in per),
        padded_costs=tuple(math.fsum(padded[p]) for p in per),
        unpadded_costs=tuple(math.fsum(unpadded[p]) for p in per),
        cost=cost_name,
        multiple=multiple,
    )


# ---------------------------------------------------------------------------------------
# Validation: every error names the public function and the argument.


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _positive_int(fn: str, arg: str, v: Any) -> int:
    if not _is_int(v):
        raise TypeError(f"{fn}: {arg} must be an int, got {v!r}")
    if v < 1:
        raise ValueError(f"{fn}: {arg} must be >= 1, got {v}")
    return int(v)


def _histogram(fn: str, lengths: Any, arg: str = "lengths") -> tuple[np.ndarray, np.ndarray]:
    """(distinct lengths increasing, their counts) as int64 arrays."""
    if isinstance(lengths, Mapping):
        keys, counts = list(lengths.keys()), list(lengths.values())
    elif isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise TypeError(
            f"{fn}: {arg} must be a sequence of positive ints or a {{length: count}} "
            f"mapping, got {type(lengths).__name__}"
        )
    else:
        keys = list(np.asarray(lengths).reshape(-1)) if hasattr(lengths, "dtype") else lengths
        keys, counts = list(keys), None
    if not keys:
        raise ValueError(f"{fn}: {arg} is empty; give at least one length")
    for x in keys:
        if not _is_int(x) or x < 1:
            raise ValueError(f"{fn}: {arg} must hold positive ints, got {x!r}")
    if counts is None:
        xs, cs = np.unique(np.asarray(keys, dtype=np.int64), return_counts=True)
        return xs, cs.astype(np.int64)
    for x, c in zip(keys, counts):
        if not _is_int(c) or c < 0:
            raise ValueError(
                f"{fn}: {arg} counts must be non-negative ints, got {c!r} for length {x}"
            )
    if sum(int(c) for c in counts) == 0:
        raise ValueError(f"{fn}: {arg} counts are all zero; give at least one length")
    order = np.argsort(np.asarray(keys, dtype=np.int64))
    return (
        np.asarray(keys, dtype=np.int64)[order],
        np.asarray([int(c) for c in counts], dtype=np.int64)[order],
    )


def _cost_model(fn: str, cost: Any) -> tuple[Callable[[int], float], str]:
    if isinstance(cost, str):
        if cost not in COST_MODELS:
            raise ValueError(
                f"{fn}: cost must be one of {sorted(COST_MODELS)} or a callable "
                f"length -> cost, got {cost!r}"
            )
        return COST_MODELS[cost], cost
    if not callable(cost):
        raise TypeError(f"{fn}: cost must be a cost name or a callable, got {cost!r}")
    return cost, getattr(cost, "__name__", type(cost).__name__)


def _costs(fn: str, cost_fn: Callable, sizes: np.ndarray) -> np.ndarray:
    """cost(s) for increasing ``sizes``, checked finite, non-negative and nondecreasing."""
    out = np.array([float(cost_fn(int(s))) for s in sizes])
    bad = ~np.isfinite(out) | (out < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"{fn}: cost must be finite and non-negative, got cost({int(sizes[i])}) = {out[i]}"
        )
    down = np.flatnonzero((np.diff(out) < 0) & (np.diff(sizes) > 0))
    if down.size:
        i = int(down[0])
        raise ValueError(
            f"{fn}: cost must be nondecreasing in the length, got cost({int(sizes[i])}) = "
            f"{out[i]} > cost({int(sizes[i + 1])}) = {out[i + 1]}"
        )
    return out


def _multiple(fn: str, multiple: Any) -> int:
    if multiple is None:
        return 1
    if multiple == "platform":
        return facts().matmul_multiple
    if isinstance(multiple, str):
        raise ValueError(f"{fn}: multiple must be an int, 'platform' or None, got {multiple!r}")
    return _positive_int(fn, "multiple", multiple)


def _check_fits(fn: str, xs: np.ndarray, limit: int, what: str) -> None:
    if xs[-1] > limit:
        raise ValueError(
            f"{fn}: length {int(xs[-1])} exceeds {what} = {limit}; raise it, or drop the "
            "longer lengths"
        )
