"""A memory-budget planner for rematerialization (in the manner of Rotor).

Given a chain and a budget of compiled temp memory (bytes) for its gradient, :func:`plan`
chooses what the backward keeps and what it recomputes, at the least recomputation:

* a scanned body ``f`` over ``n`` steps: among ``"none"``, ``"every"``, ``"sqrt"`` and
  ``"binomial"`` with any number of checkpoints. Recomputation is ``0``, ``n``, ``n`` and
  Revolve's optimum ``t(n, c) + 1 > n`` forward steps: the first that fits wins, and
  among binomials the one with the most checkpoints that fits. Memory of ``"binomial"``
  grows by about one carry per checkpoint (``m(c) ~ m(1) + (c - 1) S``, fitted from two
  compilations); the fit only guesses ``c``: compilations around the guess find the
  largest ``c`` whose compiled memory is within the budget.
* a list of heterogeneous layers ``x_{i+1} = layer_i(p_i, x_i)``: the chain is cut into
  segments, each either kept (its residuals stay until its backward) or recomputed (only
  its input stays; its backward reruns it inside a data-dependent ``lax.cond``, which
  XLA:CPU cannot hoist or CSE away, unlike ``jax.checkpoint`` around unrolled code).
  Costs per layer come from compiled figures: residual bytes (``saved_residuals``),
  activation bytes, FLOPs (``cost_analysis``). Dynamic programming over the chain, for each
  cap ``P`` on the peak of a recomputed segment, minimizes recomputed FLOPs subject to
  ``sum(kept) + P + overhead <= budget`` (memory discretized in 512 steps).

Every plan is compiled and checked against the budget; if the compiled figure exceeds
it, the planner tightens its target and plans again.

Example:
  >>> import jax, jax.numpy as jnp, cannjax
  >>> body = lambda h, w: (h + jnp.tanh(h @ w), None)
  >>> ws, h0 = jnp.full((16, 32, 32), 0.01), jnp.ones((64, 32))
  >>> p = cannjax.remat.plan(body, h0, ws, budget=2**17)
  >>> p.compiled_bytes <= 2**17, p.schedule, p.checkpoints
  (True, 'binomial', 11)
  >>> out, _ = p(h0, ws)                 # the planned scan; differentiate it as usual

References:
  Beaumont, Eyraud-Dubois, Herrmann, Joly and Shilova, "Optimal checkpointing for
  heterogeneous chains: how to train deep neural networks with limited memory" (Rotor),
  2019. https://arxiv.org/abs/1911.13214

  Griewank and Walther, "Algorithm 799: Revolve", ACM TOMS 26(1), 2000.
  https://doi.org/10.1145/347837.347846
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.ad_checkpoint import saved_residuals

from cannjax._src.remat import revolve
from cannjax._src.remat.scan import _scan_length, checkpointed_scan

_FN = "cannjax.remat.plan"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to keep and what to recompute; call it to run the planned computation.

    Attributes:
      kind: ``"scan"`` (a scanned body) or ``"chain"`` (a list of layers).
      budget: the budget in bytes of compiled temp memory of the gradient.
      predicted_bytes: the model's figure for this plan.
      compiled_bytes: compiled temp memory of ``jax.grad`` of ``loss(plan(*args))``.
      minimum_bytes: the least compiled memory any plan reaches (the feasible minimum).
      no_remat_bytes: compiled memory without rematerialization.
      recompute_flops: forward FLOPs the backward recomputes.
      gradient_flops: FLOPs of the gradient without rematerialization.
      schedule, checkpoints: the chosen :func:`cannjax.remat.checkpointed_scan` schedule (scan).
      segments: ``(start, stop, recompute)`` per segment of layers (chain).
    """

    kind: str
    budget: int
    predicted_bytes: int
    compiled_bytes: int
    minimum_bytes: int
    no_remat_bytes: int
    recompute_flops: float
    gradient_flops: float
    schedule: str | None = None
    checkpoints: int | None = None
    segments: tuple[tuple[int, int, bool], ...] = ()
    fn: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def compute_ratio(self) -> float:
        """Predicted gradient FLOPs with the plan over those without rematerialization."""
        return 1.0 + self.recompute_flops / max(self.gradient_flops, 1.0)

    def __call__(self, *args: Any) -> Any:
        """Runs the planned computation: ``(init, xs)`` for a scan, ``(params, x)`` for a chain."""
        return self.fn(*args)

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"  # noqa: E731
        what = (
            f"schedule={self.schedule!r}, checkpoints={self.checkpoints}"
            if self.kind == "scan"
            else "recompute segments "
            + (", ".join(f"[{s}:{t})" for s, t, r in self.segments if r) or "none")
        )
        return (
            f"Plan({what}): compiled {mib(self.compiled_bytes)} (predicted "
            f"{mib(self.predicted_bytes)}) within budget {mib(self.budget)}; "
            f"x{self.compute_ratio:.2f} gradient FLOPs; feasible "
            f"{mib(self.minimum_bytes)}..{mib(self.no_remat_bytes)}"
        )

    def __repr__(self) -> str:
        """The summary line of ``str``, not the dataclass fields."""
        return str(self)


def _default_loss(out: Any) -> jax.Array:
    return sum(jnp.sum(jnp.square(v)) for v in jax.tree_util.tree_leaves(out))


def _temp_bytes(fn: Callable[..., Any], *args: Any) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def _flops(fn: Callable[..., Any], *args: Any) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))


def _float_grad(apply: Callable[..., Any], loss: Callable[[Any], Any]) -> Callable[..., Any]:
    return jax.grad(lambda *args: loss(apply(*args)), argnums=(0, 1))


def plan(
    chain: Callable[..., Any] | Sequence[Callable[..., Any]],
    *args: Any,
    budget: int,
    loss: Callable[[Any], jax.Array] | None = None,
) -> Plan:
    """Plans rematerialization of ``chain`` within ``budget`` bytes at least recomputation.

    Two forms:

    * ``plan(f, init, xs, budget=...)``: ``f(carry, x) -> (carry, y)`` scanned over ``xs``
      (as for :func:`cannjax.remat.checkpointed_scan`); the plan runs ``plan(init, xs)``.
    * ``plan([layer_0, ...], params, x, budget=...)``: ``x_{i+1} = layer_i(params[i], x_i)``;
      the plan runs ``plan(params, x)`` and returns the last activation.

    The budget bounds the compiled temp memory (``memory_analysis().temp_size_in_bytes``)
    of ``jax.grad(lambda a, b: loss(plan(a, b)), (0, 1))``, which the planner compiles to
    check. The plan is for reverse mode (chain plans reject ``jax.jvp``).

    Args:
      chain: a scan body, or a sequence of layer functions ``layer(p, x) -> x``.
      *args: ``(init, xs)`` or ``(params, x)``.
      budget: bytes, an int > 0.
      loss: maps the planned output to a scalar for the check; default: sum of squares.

    Returns:
      A :class:`Plan`.

    Raises:
      ValueError: budget below the feasible minimum (the message gives the minimum), or
        malformed chain arguments.
      TypeError: budget not an int, or chain neither callable nor a sequence of callables.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"{_FN}: budget must be an int number of bytes, got {budget!r}")
    if budget <= 0:
        raise ValueError(f"{_FN}: budget must be > 0 bytes, got {budget}")
    if loss is not None and not callable(loss):
        raise TypeError(
            f"{_FN}: loss must be a callable from the planned output to a scalar, or None "
            f"(sum of squares), got {type(loss).__name__} {loss!r}"
        )
    loss = loss or _default_loss
    if callable(chain) and not isinstance(chain, (list, tuple)):
        if len(args) != 2:
            raise ValueError(f"{_FN}: a scanned body takes (init, xs), got {len(args)} arguments")
        return _plan_scan(chain, *args, budget=int(budget), loss=loss)
    if isinstance(chain, (list, tuple)) and chain and all(callable(c) for c in chain):
        if len(args) != 2:
            raise ValueError(f"{_FN}: a list of layers takes (params, x), got {len(args)} args")
        return _plan_chain(list(chain), *args, budget=int(budget), loss=loss)
    raise TypeError(
        f"{_FN}: chain must be a scan body f(carry, x) or a non-empty list of layer "
        f"functions, got {type(chain).__name__}"
    )


def _below_minimum(budget: int, minimum: int) -> ValueError:
    return ValueError(
        f"{_FN}: budget={budget} bytes ({budget / 2**20:.2f} MiB) is below the feasible "
        f"minimum of {minimum} bytes ({minimum / 2**20:.2f} MiB) for this chain; raise the "
        "budget or shrink the carried state"
    )


# ---------------------------------------------------------------- scanned bodies
def _plan_scan(f, init, xs, *, budget, loss):
    if not jax.tree_util.tree_leaves(xs):
        raise ValueError(
            f"{_FN}: xs must hold at least one array to scan over, got {xs!r}; for a body "
            "without inputs, pass xs=jnp.zeros((n, 0)) (n steps, no bytes)"
        )
    n = _scan_length(xs, None, fn=_FN)

    def runner(schedule, c):
        return lambda i, x: checkpointed_scan(f, i, x, schedule=schedule, checkpoints=c)

    measured: dict[tuple[str, int | None], int] = {}

    def measure(schedule, c=None):
        if (schedule, c) not in measured:
            grad = _float_grad(runner(schedule, c), loss)
            measured[schedule, c] = _temp_bytes(grad, init, xs)
        return measured[schedule, c]

    step_fwd = step_grad = 0.0
    if n:
        x0 = jax.tree_util.tree_map(lambda a: a[0], xs)
        step_fwd = _flops(f, init, x0)
        step_grad = _flops(jax.grad(lambda i, x: _default_loss(f(i, x)), (0, 1)), init, x0)
    gradient_flops = n * max(step_grad, step_fwd)
    if n < 3:
        got = measure("none")
        if budget < got:
            raise _below_minimum(budget, got)
        return Plan(
            "scan",
            budget,
            got,
            got,
            got,
            got,
            0.0,
            gradient_flops,
            "none",
            None,
            (),
            runner("none", None),
        )
    none_b = measure("none")
    sq = math.isqrt(n - 1) + 1
    # Least recomputation first: none, then every and sqrt (n steps; at equal
    # recomputation "every" is faster: no nested loops, benchmarks/remat.py), then
    # binomial (t(n, c) + 1 > n steps for c <= n - 2).
    simple = [("none", None, 0), ("every", None, n), ("sqrt", sq, n)]
    m1, m2 = measure("binomial", 1), measure("binomial", 2)
    minimum = min(m1, *(measure(s, c) for s, c, _ in simple))
    if budget < minimum:
        raise _below_minimum(budget, minimum)
    for schedule, c, extra in simple:
        got = measure(schedule, c)
        if got <= budget:
            return Plan(
                "scan",
                budget,
                got,
                got,
                minimum,
                none_b,
                extra * step_fwd,
                gradient_flops,
                schedule,
                c,
                (),
                runner(schedule, c),
            )
    # Binomial: recomputation falls and memory grows with c, and c = 1 fits (it is the
    # minimum, the others being over the budget).
    slope = max(m2 - m1, 0)
    guess = 1 + (budget - m1) // slope if slope else n - 2
    c = _largest_fitting(lambda c: measure("binomial", c), budget, n - 2, guess)
    return Plan(
        "scan",
        budget,
        m1 + (c - 1) * slope,
        measure("binomial", c),
        minimum,
        none_b,
        (revolve.advances(n, c) + 1) * step_fwd,
        gradient_flops,
        "binomial",
        c,
        (),
        runner("binomial", c),
    )


def _largest_fitting(size: Callable[[int], int], budget: int, top: int, guess: int) -> int:
    """The largest ``c`` in ``[1, top]`` with ``size(c) <= budget``, for ``size`` increasing.

    ``size(1) <= budget``. Each ``size`` call compiles, so the search starts at ``guess``
    (the linear fit, off by alignment by a step or two), moves away from it in steps of
    1, 1, 2, 4, ... until it crosses the budget, then bisects the last step: a guess off
    by one costs three compilations at most.
    """
    lo, hi = 1, top  # size(lo) fits; nothing above hi does
    c = min(max(guess, lo), hi)
    if size(c) <= budget:
        lo = c
        for k in itertools.count():
            if lo == hi:
                break
            c = min(lo + (1 << max(k - 1, 0)), hi)
            if size(c) > budget:
                hi = c - 1
                break
            lo = c
    else:
        hi = c - 1
        for k in itertools.count():
            if lo == hi:
                break
            c = max(hi - (1 << max(k - 1, 0)) + 1, lo + 1)
            if size(c) <= budget:
                lo = c
                break
            hi = c - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------- heterogeneous chains
def _tree_bytes(tree) -> int:
    return sum(
        int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize for v in jax.tree_util.tree_leaves(tree)
    )


def _compose(layers):
    def run(params, x):
        for layer, p in zip(layers, params):
            x = layer(p, x)
        return x

    return run


def _recomputed(g):
    """``g`` whose backward reruns it from its inputs, after the cotangent is known."""

    @jax.custom_vjp
    def h(params, x):
        return g(params, x)

    def fwd(params, x):
        return g(params, x), (params, x)

    def bwd(res, ct):
        def rerun(params, x, ct):
            return jax.vjp(g, params, x)[1](ct)

        # A predicate XLA cannot evaluate keeps the rerun after the cotangent exists and
        # out of reach of CSE with the forward; both branches are the same computation.
        leaf = jax.tree_util.tree_leaves(ct)[0].ravel()[0]
        return lax.cond(leaf == leaf, rerun, rerun, *res, ct)

    h.defvjp(fwd, bwd)
    return h


def _chain_runner(layers, segments):
    parts = []
    for s, t, rec in segments:
        g = _compose(layers[s:t])
        parts.append((s, t, _recomputed(g) if rec else g))

    def run(params, x):
        for s, t, g in parts:
            x = g(tuple(params[s:t]), x)
        return x

    return run


def _plan_chain(layers, params, x, *, budget, loss):
    n = len(layers)
    if not isinstance(params, (list, tuple)) or len(params) != n:
        got = len(params) if isinstance(params, (list, tuple)) else type(params).__name__
        raise ValueError(f"{_FN}: params must be a list with one entry per layer ({n}), got {got}")
    params = list(params)
    acts, a_bytes, r_bytes, flops = [x], [], [], []
    for i, (layer, p) in enumerate(zip(layers, params)):
        xi = acts[-1]
        a_bytes.append(_tree_bytes(xi))
        res = saved_residuals(lambda p_, x_, layer=layer: _default_loss(layer(p_, x_)), p, xi)
        r_bytes.append(
            sum(
                int(np.prod(av.shape)) * av.dtype.itemsize
                for av, src in res
                if "from the argument" not in src
            )
        )
        flops.append(_flops(layer, p, xi))
        try:
            acts.append(jax.eval_shape(layer, p, xi))
        except Exception as e:  # noqa: BLE001 -- re-raised with the layer's index
            raise ValueError(f"{_FN}: layer {i} fails on its input: {e}") from e
    a = np.asarray(a_bytes, np.float64)
    r = np.asarray(r_bytes, np.float64)
    fl = np.asarray(flops, np.float64)

    def compile_plan(segments):
        return _temp_bytes(_float_grad(_chain_runner(layers, segments), loss), params, x)

    keep_all = tuple((i, i + 1, False) for i in range(n))
    none_b = compile_plan(keep_all)
    kept_model = float(np.sum(r + a * (np.arange(n) > 0)))
    overhead = max(none_b - kept_model, 0.0)
    grad_flops = float(np.sum(fl)) * 3.0

    cr, ca = np.concatenate([[0.0], np.cumsum(r)]), np.concatenate([[0.0], np.cumsum(a)])

    def peak(s, t):
        return float(cr[t] - cr[s] + max(ca[t] - ca[s + 1], 0.0))

    def keep_cost(i):
        return float(r[i] + (a[i] if i > 0 else 0.0))

    def store_cost(s):
        return float(a[s]) if s > 0 else 0.0

    # Least memory: for each cap on a recomputed segment's peak, least stored memory.
    caps = sorted({peak(s, t) for s in range(n) for t in range(s + 1, n + 1)})
    if len(caps) > 48:  # a spread of caps keeps the planner fast on long chains
        caps = [caps[int(k)] for k in np.linspace(0, len(caps) - 1, 48)]

    def min_memory_plan():
        best = (math.inf, None)
        for cap in [0.0, *caps]:
            dp, back = [0.0] + [math.inf] * n, [None] * (n + 1)
            for j in range(1, n + 1):
                for i in range(j):
                    rec = peak(i, j) <= cap
                    for recompute in (False, True) if rec else (False,):
                        if not recompute and j != i + 1:
                            continue
                        v = dp[i] + (store_cost(i) if recompute else keep_cost(i))
                        if v < dp[j]:
                            dp[j], back[j] = v, (i, recompute)
            total = dp[n] + cap
            if total < best[0]:
                best = (total, _segments(back, n))
        return best

    min_pred, min_segs = min_memory_plan()
    minimum = compile_plan(min_segs)
    if budget < minimum:
        raise _below_minimum(budget, minimum)
    if budget >= none_b:
        return Plan(
            "chain",
            budget,
            none_b,
            none_b,
            minimum,
            none_b,
            0.0,
            grad_flops,
            segments=keep_all,
            fn=_chain_runner(layers, keep_all),
        )
    compiled: dict[tuple, int] = {}

    def attempt(target):
        """The least-recomputation plan within ``target`` (model bytes), and its compiled bytes."""
        segs, pred, extra = _least_compute(
            n, target - overhead, caps, peak, keep_cost, store_cost, fl
        )
        if segs is None:
            return None
        if segs not in compiled:
            compiled[segs] = compile_plan(segs)
        return segs, pred, extra, compiled[segs]

    # Tighten the target until the compiled plan fits...
    fit, fit_target, over_target, target = None, float(budget), float(none_b), float(budget)
    for _ in range(4):
        tried = attempt(target)
        if tried is None:
            break
        if tried[3] <= budget:
            fit, fit_target = tried, target
            break
        over_target = min(over_target, target)
        target -= tried[3] - budget + 0.01 * budget
    if fit is None:
        min_extra = float(sum(fl[s:t].sum() for s, t, rc in min_segs if rc))
        fit = (min_segs, min_pred, min_extra, minimum)
    else:
        # ...then loosen it while it still fits: the model overestimates what a plan
        # keeps (XLA reuses buffers), so a looser target may cost less recomputation.
        # At over_target the plan is over the budget (at none_b it keeps everything).
        for _ in range(4):
            if over_target - fit_target < 0.01 * budget:
                break
            target = (fit_target + over_target) / 2
            tried = attempt(target)
            if tried is not None and tried[3] <= budget:
                fit_target = target
                fit = min(fit, tried, key=lambda a: a[2])
            else:
                over_target = target
    segs, pred, extra, got = fit
    return Plan(
        "chain",
        budget,
        int(pred + overhead),
        got,
        minimum,
        none_b,
        extra,
        grad_flops,
        segments=segs,
        fn=_chain_runner(layers, segs),
    )


def _segments(back, n):
    segs, j = [], n
    while j > 0:
        i, rec = back[j]
        segs.append((i, j, bool(rec)))
        j = i
    return tuple(reversed(segs))


def _least_compute(n, avail, caps, peak, keep_cost, store_cost, fl, buckets=512):
    """Least recomputed FLOPs with ``sum(stored) + cap <= avail``, over caps."""
    best = (math.inf, None, None)
    cum = np.concatenate([[0.0], np.cumsum(fl)])
    for cap in [0.0, *caps]:
        room = avail - cap
        if room < 0:
            continue
        q = max(room, 1.0) / buckets
        size = lambda v, q=q: int(math.ceil(v / q - 1e-9))  # noqa: E731
        dp = np.full((n + 1, buckets + 1), np.inf)
        dp[0, 0] = 0.0
        back_i = np.zeros((n + 1, buckets + 1), np.int64)
        back_m = np.zeros((n + 1, buckets + 1), np.int64)
        back_r = np.zeros((n + 1, buckets + 1), bool)
        for j in range(1, n + 1):
            for i in range(j):
                options = [(True, store_cost(i), cum[j] - cum[i])] if peak(i, j) <= cap else []
                if j == i + 1:
                    options.append((False, keep_cost(i), 0.0))
                for rec, mem, comp in options:
                    k = size(mem)
                    if k > buckets:
                        continue
                    cand = dp[i, : buckets + 1 - k] + comp
                    better = cand < dp[j, k:]
                    if better.any():
                        idx = np.nonzero(better)[0]
                        dp[j, k + idx] = cand[idx]
                        back_i[j, k + idx], back_m[j, k + idx], back_r[j, k + idx] = i, idx, rec
        m_best = int(np.argmin(dp[n]))
        if dp[n, m_best] < best[0]:
            segs, j, m = [], n, m_best
            while j > 0:
                i, m_prev, rec = int(back_i[j, m]), int(back_m[j, m]), bool(back_r[j, m])
                segs.append((i, j, rec))
                j, m = i, m_prev
            segs = tuple(reversed(segs))
            stored = sum(store_cost(s) if rc else keep_cost(s) for s, t, rc in segs)
            pk = max([peak(s, t) for s, t, rc in segs if rc], default=0.0)
            best = (float(dp[n, m_best]), segs, stored + pk)
    if best[1] is None:
        return None, None, None
    return best[1], best[2], best[0]
