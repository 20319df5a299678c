"""Binomial checkpointing (Revolve): optimal recomputation counts and schedules.

Reversing a chain of ``n`` steps ``s_{i+1} = f(s_i)`` needs every state ``s_i`` once more,
in reverse order. With room for ``c`` stored states (checkpoints) besides the working
state, Griewank (1992) showed that the least number of forward steps (advances) is

    t(n, c) = r n - beta(c + 1, r - 1),   beta(c, r) = C(c + r, c),

where ``r`` is the least integer with ``beta(c, r) >= n`` (each step is advanced at most
``r`` times). The initial forward sweep is included; the ``n`` taped steps (a forward that
keeps the step's residuals, followed by its backward) are not.

The schedule is the binomial recursion: to reverse steps ``[a, b)`` with state ``a`` at
hand and ``c`` slots (one holds ``s_a``), advance ``k`` steps to ``m = a + k``, store
``s_m`` in a free slot, reverse ``[m, b)`` with ``c - 1`` slots, then restore ``s_a`` and
reverse ``[a, m)`` with ``c`` slots. ``k`` minimizes ``k + t(b - m, c - 1) + t(k, c)``.

Example:
  >>> from cannjax.remat import revolve
  >>> revolve.advances(64, 10), revolve.advances(64, 63), revolve.advances(4, 1)
  (116, 63, 6)
  >>> s = revolve.schedule(8, 2)
  >>> s.forward_stores       # (state, slot) stored during the forward sweep
  ((0, 0), (4, 1))
  >>> s.advances == revolve.advances(8, 2)
  True

References:
  Griewank, "Achieving Logarithmic Growth of Temporal and Spatial Complexity in Reverse
  Automatic Differentiation", Optimization Methods and Software 1(1), 1992.
  https://doi.org/10.1080/10556789208805505

  Griewank and Walther, "Algorithm 799: Revolve: An Implementation of Checkpointing for
  the Reverse or Adjoint Mode of Computational Differentiation", ACM TOMS 26(1), 2000.
  https://doi.org/10.1145/347837.347846
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np


def _beta(c: int, r: int) -> int:
    """``C(c + r, c)``: the most steps ``c`` slots reverse with ``r`` repetitions."""
    if r < 0:
        return 0
    return math.comb(c + r, c)


def _reps(n: int, c: int) -> int:
    r = 0
    while _beta(c, r) < n:
        r += 1
    return r


def advances(n: int, c: int) -> int:
    """Griewank's least number of forward advances to reverse ``n`` steps with ``c`` slots.

    Args:
      n: number of steps, ``n >= 1``.
      c: number of checkpoint slots, ``c >= 1`` (one holds the initial state).

    Returns:
      ``t(n, c) = r n - C(c + r, c + 1)`` with ``r`` least such that ``C(c + r, c) >= n``.
    """
    if n < 1 or c < 1:
        raise ValueError(f"cannjax.remat.revolve.advances: need n >= 1, c >= 1, got {n}, {c}")
    if c >= n - 1:
        return n - 1
    r = _reps(n, c)
    return r * n - _beta(c + 1, r - 1)


def advances_dp(n: int, c: int) -> int:
    """The same optimum by dynamic programming over splits (slow; for checking).

    ``F(l, 1) = l (l - 1) / 2``, ``F(1, c) = 0``, and
    ``F(l, c) = min_{0 < k < l} k + F(l - k, c - 1) + F(k, c)``.
    """

    @functools.cache
    def f(length: int, slots: int) -> int:
        if length == 1:
            return 0
        if slots == 1:
            return length * (length - 1) // 2
        return min(k + f(length - k, slots - 1) + f(k, slots) for k in range(1, length))

    return f(n, c)


def default_checkpoints(n: int) -> int:
    """Least ``c`` with ``(c + 1)(c + 2) / 2 >= n``: each step advanced at most twice.

    This gives ``O(sqrt(2 n))`` stored carries at about one extra forward sweep
    (``t(n, c) = 2 n - c - 2``).
    """
    if n <= 2:
        return 1
    c = 1
    while _beta(c, 2) < n:
        c += 1
    return c


@functools.lru_cache(maxsize=4096)
def _split(length: int, slots: int) -> int:
    ks = np.arange(1, length)
    costs = [k + _cost(length - k, slots - 1) + _cost(k, slots) for k in ks]
    best = int(np.argmin(costs))
    return int(ks[best])


def _cost(length: int, slots: int) -> int:
    return 0 if length <= 1 else advances(length, slots)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A binomial schedule in the flat form a loop executes.

    Attributes:
      n: steps; c: checkpoint slots.
      forward_stores: ``(state, slot)`` pairs stored during the forward sweep, in order;
        the first is ``(0, 0)``. The forward sweep also keeps ``s_{n-1}`` as the working
        state, so the first backward step needs no recomputation.
      src: ``src[i]`` is the slot restored before reversing step ``i`` (``i < n - 1``).
      run_ptr: runs of reverse step ``i`` are ``run_ptr[i]:run_ptr[i + 1]``.
      run_start, run_stop, run_slot: run ``j`` advances from state ``run_start[j]`` to
        ``run_stop[j]`` and stores it in slot ``run_slot[j]``.
      final_start: state from which step ``i`` is finally reached (advance to ``i``).
      advances: forward advances in all (initial sweep to ``s_{n-1}`` included).
    """

    n: int
    c: int
    forward_stores: tuple[tuple[int, int], ...]
    src: np.ndarray
    run_ptr: np.ndarray
    run_start: np.ndarray
    run_stop: np.ndarray
    run_slot: np.ndarray
    final_start: np.ndarray
    advances: int

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(run_start, run_stop, run_slot)``."""
        return self.run_start, self.run_stop, self.run_slot

    @property
    def backward_advances(self) -> int:
        """Advances executed by the backward pass (recomputation beyond the forward)."""
        return self.advances - (self.n - 1)


@functools.lru_cache(maxsize=128)
def schedule(n: int, c: int) -> Schedule:
    """The optimal binomial schedule for ``n`` steps and ``c`` slots (see module doc)."""
    if n < 1 or c < 1:
        raise ValueError(f"cannjax.remat.revolve.schedule: need n >= 1, c >= 1, got {n}, {c}")
    c = min(c, max(n - 1, 1))
    acts: list[tuple] = [("store", 0, 0)]

    def rev(a: int, b: int, slot: int, free: tuple[int, ...], current: bool) -> None:
        length = b - a
        if length == 1 or not free:
            for i in range(b - 1, a - 1, -1):
                if not current:
                    acts.append(("restore", slot, a))
                if i > a:
                    acts.append(("advance", a, i))
                acts.append(("reverse", i))
                current = False
            return
        m = a + _split(length, len(free) + 1)
        if not current:
            acts.append(("restore", slot, a))
        acts.append(("advance", a, m))
        acts.append(("store", m, free[0]))
        rev(m, b, free[0], free[1:], True)
        rev(a, m, slot, free, False)

    rev(0, n, 0, tuple(range(1, c)), True)

    # Flatten: forward part, then one group per reverse step.
    first = next(j for j, a in enumerate(acts) if a[0] == "reverse")
    fwd = acts[:first]
    forward_stores = tuple((a[1], a[2]) for a in fwd if a[0] == "store")
    total = sum(a[2] - a[1] for a in acts if a[0] == "advance")
    src = np.zeros(n, np.int32)
    final_start = np.zeros(n, np.int32)
    run_ptr = np.zeros(n + 1, np.int32)
    runs: dict[int, list[tuple[int, int, int]]] = {}
    group: list[tuple] = []
    for a in acts[first + 1 :]:
        if a[0] != "reverse":
            group.append(a)
            continue
        i = a[1]
        assert group and group[0][0] == "restore", group
        src[i], pos = group[0][1], group[0][2]
        run_begin, rs = pos, []
        for g in group[1:]:
            if g[0] == "advance":
                assert g[1] == pos
                pos = g[2]
            else:
                rs.append((run_begin, pos, g[2]))
                run_begin = pos
        assert pos == i, (pos, i)
        runs[i], final_start[i] = rs, run_begin
        group = []
    flat = []
    for i in range(n):
        run_ptr[i] = len(flat)
        flat.extend(runs.get(i, []))
    run_ptr[n] = len(flat)
    arr = np.asarray(flat, np.int32).reshape(-1, 3)
    return Schedule(
        n=n,
        c=c,
        forward_stores=forward_stores,
        src=src,
        run_ptr=run_ptr,
        run_start=arr[:, 0].copy(),
        run_stop=arr[:, 1].copy(),
        run_slot=arr[:, 2].copy(),
        final_start=final_start,
        advances=total,
    )
