"""``check_op``: the harness every cannjax operator passes.

For an operator ``f`` (given as its public function, registry name or spec) and
arguments ``x``, :func:`check_op` verifies, raising an ``AssertionError`` that names the
failed check and by how much:

1. value: ``f(x)`` against the plain-jax.numpy reference, and no NaN;
2. reverse mode: ``vjp`` against the reference's (unless the reference is known to be
   wrong at this point), against ``expected_grad`` when given, and no NaN;
3. finite differences: in float64 (scoped ``jax.enable_x64``), the JVP along a random,
   magnitude-scaled direction ``u`` against ``(f(x + h u) - f(x - h u)) / 2h``;
4. forward against reverse: ``<J u, w> == <u, J^T w>``, or, where the gradient has an
   infinite entry (``entropy`` at ``p = 0``), the Jacobian built by forward mode against
   the one built by reverse mode, entry by entry;
5. vmap: ``vmap(f)`` and ``vmap(vjp)`` against per-example results;
6. jit: ``jit(f)`` and ``jit(vjp)`` against eager results;
7. second order, for the scalar ``s(x) = <w, f(x)>`` and a random direction ``u``: the
   Hessian-vector product by forward-over-reverse (``jvp`` of ``grad``) and by
   reverse-over-reverse (``grad`` of ``<grad s, u>``) agree with each other, with
   ``jacfwd(grad s) u`` and with ``hessian(s) u`` (for up to 64 differentiated entries),
   with plain autodiff of the reference, and with float64 central differences of the
   gradient; at non-finite points (an edge case with ``+-inf``) they have no NaN where
   the gradient is finite, and equal their limit: the same product at the point with
   each ``+-inf`` replaced by ``+-1e30``.

Every pairing is strict: ``expected_grad`` must hold one gradient per differentiable
argument and ``expected_value`` one array per output, and tolerances must be finite (a
comparison that cannot fail is turned off with its flag instead).

Example:
  >>> import cannjax, jax.numpy as jnp
  >>> cannjax.testing.check_op(cannjax.ops.tanh, jnp.array([0.0, 1.0, -2.0]))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cannjax._src.core.registry import OpSpec, lookup

_TOL = {  # (rtol, atol) for comparisons at the arguments' dtype
    "float64": (1e-9, 1e-12),
    "float32": (2e-5, 1e-6),
    "bfloat16": (3e-2, 1e-2),
    "float16": (5e-3, 1e-3),
}
_FD_STEP = 1e-4  # relative step of the float64 central differences
_FD_TOL = (1e-5, 1e-8)


# Random directions and cotangents: jax.random's values, drawn with fewer compiles. Each
# new shape of jax.random.normal compiles a threefry program (0.15-0.6 s on XLA:CPU), and
# check_op draws several per call. With partitionable threefry (jax's default) entry i of
# a draw depends only on the key and i, so a draw of ``shape`` is the prefix of a flat
# draw of a power-of-two size: one program per size class and dtype.
Key = jax.Array


def _split(key: Key, n: int) -> list[Key]:
    """``n`` independent child keys of ``key`` (``jax.random.split``)."""
    return list(jax.random.split(key, n))


def _normal(key: Key, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``jax.random.normal(key, shape, dtype)``, its values exactly."""
    if not jax.config.jax_threefry_partitionable:
        return jax.random.normal(key, shape, dtype)
    n = math.prod(shape)
    flat = jax.random.normal(key, (max(256, 1 << max(n - 1, 0).bit_length()),), dtype)
    return jnp.asarray(np.asarray(flat)[:n].reshape(shape))


def tolerance(dtype: Any) -> tuple[float, float]:
    """``(rtol, atol)`` used by :func:`check_op` for values of ``dtype``."""
    return _TOL.get(jnp.dtype(dtype).name, _TOL["float32"])


def _check_tolerance(name: str, check: str | None, rtol: float, atol: float) -> None:
    """ValueError unless ``rtol`` and ``atol`` are finite and >= 0: an infinite tolerance
    makes a check pass whatever the operator returns."""
    where = f"check_op({name}): " + (f"{check}: " if check else "")
    for what, tol in (("rtol", rtol), ("atol", atol)):
        if isinstance(tol, bool) or not isinstance(tol, (int, float, np.floating)):
            raise TypeError(f"{where}{what} must be a float, got {tol!r}")
        if not (math.isfinite(tol) and tol >= 0):
            raise ValueError(
                f"{where}{what} must be finite and >= 0, got {tol!r}; to skip a "
                "comparison that does not apply, turn it off with its flag "
                "(reference_value=False, reference_grad=False, finite_differences=False)"
            )


def _strict_zip(name: str, what: str, *seqs: Sequence[Any]):
    """``zip(*seqs)``, or AssertionError naming check_op, the op and the lengths if they
    differ (a check that would otherwise compare only the shorter part)."""
    lengths = [len(s) for s in seqs]
    if len(set(lengths)) > 1:
        raise AssertionError(
            f"check_op({name}): {what}: lengths differ ({' vs '.join(map(str, lengths))})"
        )
    return zip(*seqs, strict=True)


def _fail(name: str, check: str, got: Any, want: Any, rtol: float, atol: float) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"check_op({name}): {check}: shape {got.shape} != {want.shape}")
    with np.errstate(invalid="ignore"):
        err = np.where(
            np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True), 0.0, np.abs(got - want)
        )
    err = np.where(np.isnan(err), np.inf, err)
    i = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
    raise AssertionError(
        f"check_op({name}): {check} failed: max abs error {err.max():.3g} at index "
        f"{tuple(int(k) for k in i)} (got {got[i]!r}, expected {want[i]!r}; "
        f"rtol={rtol:g}, atol={atol:g})"
    )


def _assert_close(name, check, got, want, rtol, atol):
    _check_tolerance(name, check, rtol, atol)
    leaves = (jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    for g, w in _strict_zip(name, f"{check}: arrays got vs expected", *leaves):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g64.shape != w64.shape or not np.allclose(
            g64, w64, rtol=rtol, atol=atol, equal_nan=True
        ):
            _fail(name, check, g64, w64, rtol, atol)


def _assert_no_nan(name, check, tree):
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.asarray(leaf, np.float64)
        if np.isnan(a).any():
            raise AssertionError(
                f"check_op({name}): {check} has NaN at {np.argwhere(np.isnan(a))[:5].tolist()}"
            )


def _np64(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def _flat_out(f):
    return lambda *a: jax.tree_util.tree_leaves(f(*a))


def check_op(
    op: str | Callable[..., Any] | OpSpec,
    *args: Any,
    finite_differences: bool = True,
    reference_value: bool = True,
    reference_grad: bool = True,
    expected_value: Any = None,
    expected_grad: Sequence[Any] | None = None,
    second_order: bool = True,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: Any,
) -> None:
    """Checks an operator's value and derivatives at ``args`` (see the module doc).

    Args:
      op: the public function, registry name or :class:`~cannjax.core.OpSpec`.
      *args: positional arguments; float arguments not in ``nondiff_argnums`` are
        differentiated. Half-precision arguments are checked for the value only.
      finite_differences: run the float64 finite-difference check (turn off at kinks and
        non-finite inputs).
      reference_value: compare the value with the reference (turn off where the
        reference gives NaN and cannjax gives the limit).
      reference_grad: compare gradients with plain autodiff of the reference (turn off
        where that gives NaN and cannjax does not).
      expected_value: the exact value of ``f(x)``, when known.
      expected_grad: exact gradients of ``sum(f(x))``, a sequence with one entry per
        differentiable argument, in order.
      second_order: run the second-order checks (item 7 of the module doc); the
        comparisons with the reference and with finite differences follow
        ``reference_grad`` and ``finite_differences``.
      seed: seed of the random directions and cotangents.
      rtol: relative tolerance of the value and gradient comparisons; by default
        :func:`tolerance` of the arguments' dtype. Must be finite and >= 0: a check
        that does not apply at a point is turned off with its flag, never loosened to
        infinity.
      atol: absolute tolerance, likewise.
      **kwargs: keyword arguments of the operator (``approximate=True``, ``axis=0``...).

    Raises:
      AssertionError: naming the failed check and the size of the error.
      ValueError: if ``expected_grad`` does not hold one gradient per differentiable
        argument, ``expected_value`` not one array per output, or a tolerance is not
        finite and >= 0.
      TypeError: if ``expected_grad`` is not a tuple or list, or a tolerance not a number.
    """
    spec = lookup(op)
    name = spec.name + (f"{kwargs}" if kwargs else "")
    fn = functools.partial(spec.fn, **kwargs)
    ref = functools.partial(spec.reference, **kwargs)
    args = tuple(jnp.asarray(a) for a in args)
    argnums = tuple(i for i, a in enumerate(args) if i not in spec.nondiff_argnums and _is_float(a))
    dtype = args[argnums[0]].dtype if argnums else jnp.float32
    default_rtol, default_atol = tolerance(dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    _check_tolerance(name, None, rtol, atol)
    if expected_grad is not None:
        if not isinstance(expected_grad, (tuple, list)):
            raise TypeError(
                f"check_op({name}): expected_grad must be a tuple with one gradient per "
                f"differentiable argument (positions {argnums}), got "
                f"{type(expected_grad).__name__}"
            )
        if len(expected_grad) != len(argnums):
            raise ValueError(
                f"check_op({name}): expected_grad has {len(expected_grad)} gradient(s) but "
                f"the operator has {len(argnums)} differentiable argument(s) (positions "
                f"{argnums}); give one gradient per differentiable argument"
            )

    out = fn(*args)
    if expected_value is not None:
        n_out = len(jax.tree_util.tree_leaves(out))
        n_want = len(jax.tree_util.tree_leaves(expected_value))
        if n_out != n_want:
            raise ValueError(
                f"check_op({name}): expected_value has {n_want} array(s) but the operator "
                f"returns {n_out}; give one expected array per output"
            )
    _assert_no_nan(name, "value", out)
    if reference_value:
        _assert_close(name, "value against reference", out, jax.jit(ref)(*args), rtol, atol)
    if expected_value is not None:
        _assert_close(name, "value against expected", out, expected_value, rtol, atol)
    if jnp.finfo(dtype).bits < 32 or not argnums:
        return

    keys = _split(jax.random.key(seed), 4)
    w = jax.tree_util.tree_map(lambda o: _normal(keys[0], o.shape, o.dtype), out)

    def vjp_of(f, *a):
        def partial_f(*diff):
            full = list(a)
            for i, d in _strict_zip(name, "differentiable arguments", argnums, diff):
                full[i] = d
            return f(*full)

        return jax.vjp(partial_f, *(a[i] for i in argnums))

    def grads_of(f, *a, cot=w):
        return vjp_of(f, *a)[1](cot)

    grads = grads_of(fn, *args)
    _assert_no_nan(name, "gradient", grads)
    if reference_grad:
        want = jax.jit(lambda *a: grads_of(ref, *a))(*args)
        _assert_close(name, "gradient against reference", grads, want, rtol, atol)
    if expected_grad is not None:
        ones = jax.tree_util.tree_map(jnp.ones_like, out)
        got = grads_of(fn, *args, cot=ones)
        want = tuple(jnp.asarray(e, dtype) for e in expected_grad)
        _assert_close(name, "gradient against expected", got, want, rtol, atol)

    finite = all(np.isfinite(_np64(args[i])).all() for i in argnums)
    if finite_differences and finite:
        _check_finite_differences(name, fn, args, argnums, keys[1])
    if finite:
        _check_forward_vs_reverse(name, fn, args, argnums, w, keys[2], rtol, atol)
    _check_vmap(name, fn, args, argnums, w, grads, vjp_of, rtol, atol)
    jit_out = jax.jit(fn)(*args)
    _assert_close(name, "jit value", jit_out, out, rtol, atol)
    jit_grads = jax.jit(lambda *a: grads_of(fn, *a))(*args)
    _assert_close(name, "jit gradient", jit_grads, grads, rtol, atol)
    if second_order:
        gradient_finite = all(np.isfinite(_np64(g)).all() for g in jax.tree_util.tree_leaves(grads))
        check = _SecondOrder(name, fn, ref, args, argnums, keys[3], rtol, atol)
        check.run(
            finite=finite,
            gradient_finite=gradient_finite,
            reference=reference_grad,
            finite_differences=finite_differences,
        )


def _scaled_direction(name, key, args, argnums):
    """A random direction, scaled per entry by ``clip(|x|, |x| * 1e-6, 1)`` (1 at 0).

    Tiny entries get relative steps (``log`` at 1e-30 stays in its domain); moderate ones
    an absolute step, since ``sin`` at 1e4 still varies on a scale of 1; huge ones a step
    of many ulps (``sqrt`` at 1e30).
    """
    ks = _split(key, len(argnums))
    out = []
    for k, i in _strict_zip(name, "random keys and differentiable arguments", ks, argnums):
        x = args[i]
        mag = jnp.abs(x)
        scale = jnp.where(x != 0, jnp.maximum(jnp.minimum(mag, 1.0), mag * 1e-6), 1.0)
        out.append(_normal(k, x.shape, x.dtype) * scale)
    return out


def _with(name, args, argnums, values):
    full = list(args)
    for i, v in _strict_zip(name, "differentiable arguments and their values", argnums, values):
        full[i] = v
    return full


def _check_finite_differences(name, fn, args, argnums, key):
    check = "float64 JVP against central finite differences"
    with jax.enable_x64(True):
        a64 = [jnp.asarray(a, jnp.float64) if _is_float(a) else a for a in args]
        u = _scaled_direction(name, key, a64, argnums)
        f = _flat_out(fn)

        # One program for the five evaluations (compiling is most of check_op's time);
        # every argument is a parameter of it, so that a sweep over points reuses it.
        @jax.jit
        def run(a64, u):
            primals = tuple(a64[i] for i in argnums)

            def along(t):
                return f(*_with(name, a64, argnums, [p + t * d for p, d in zip(primals, u)]))

            h = _FD_STEP
            # Fourth-order central stencil: truncation error O(h^4) even where the
            # magnitude-scaled step is large in absolute terms (sin at x = 1e4).
            f2, f1, m1, m2 = along(2 * h), along(h), along(-h), along(-2 * h)
            fd = [
                (-a + 8 * b - 8 * c + d) / (12 * h)
                for a, b, c, d in _strict_zip(name, check, f2, f1, m1, m2)
            ]
            _, jvp = jax.jvp(lambda *d: f(*_with(name, a64, argnums, d)), primals, u)
            return jvp, fd

        jvp, fd = run(a64, tuple(u))
        scale = max(1.0, max(float(np.max(np.abs(_np64(t)))) for t in jvp))
        if not math.isfinite(scale):
            raise AssertionError(
                f"check_op({name}): {check}: the JVP is not finite at finite arguments, so "
                "finite differences do not apply; pass finite_differences=False and check "
                "the derivative with expected_grad"
            )
        _assert_close(name, check, jvp, fd, _FD_TOL[0], _FD_TOL[1] * scale)


def _check_forward_vs_reverse(name, fn, args, argnums, w, key, rtol, atol):
    check = "forward against reverse mode"
    keys = _split(key, len(argnums))
    u = [
        _normal(k, args[i].shape, args[i].dtype) for k, i in _strict_zip(name, check, keys, argnums)
    ]

    def partial_f(*d, args=args):
        return fn(*_with(name, args, argnums, d))

    @jax.jit
    def both_modes(args, u, w):
        primals = tuple(args[i] for i in argnums)
        _, jvp = jax.jvp(lambda *d: partial_f(*d, args=args), primals, u)
        return jvp, jax.vjp(lambda *d: partial_f(*d, args=args), *primals)[1](w)

    primals = tuple(args[i] for i in argnums)
    jvp, vjp = both_modes(list(args), tuple(u), w)
    leaves = jax.tree_util.tree_leaves(vjp)
    mag = max(1.0, sum(float(np.sum(np.abs(_np64(x)))) for x in leaves))
    if not math.isfinite(mag):
        # An infinite derivative (entropy at p = 0): <J u, w> is inf or NaN, so compare
        # the Jacobians of both modes instead, where equal infinities compare equal.
        _check_jacobians(name, partial_f, primals, rtol, atol)
        return

    def dot(a, b):
        pairs = _strict_zip(name, check, jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
        return sum(float(np.vdot(_np64(x), _np64(y))) for x, y in pairs)

    lhs, rhs = dot(jvp, w), dot(u, vjp)
    _check_tolerance(name, check, rtol * 10, atol * 10 * mag)
    if not np.isclose(lhs, rhs, rtol=rtol * 10, atol=atol * 10 * mag):
        raise AssertionError(
            f"check_op({name}): forward against reverse mode failed: <J u, w> = {lhs!r} but "
            f"<u, J^T w> = {rhs!r} (difference {abs(lhs - rhs):.3g})"
        )


def _check_jacobians(name, f, primals, rtol, atol):
    argnums = tuple(range(len(primals)))
    forward = jax.jacfwd(f, argnums=argnums)(*primals)
    reverse = jax.jacrev(f, argnums=argnums)(*primals)
    _assert_no_nan(name, "forward-mode Jacobian", forward)
    _assert_no_nan(name, "reverse-mode Jacobian", reverse)
    _assert_close(
        name, "forward against reverse mode (Jacobians)", forward, reverse, rtol * 10, atol * 10
    )


def _check_vmap(name, fn, args, argnums, w, grads, vjp_of, rtol, atol):
    # Batch of two: the arguments and the arguments with float inputs halved.
    # Stacked with numpy: an eager jnp.stack compiles a program per shape.
    def stack(*xs):
        return jnp.asarray(np.stack([np.asarray(x) for x in xs]))

    second = [jnp.asarray(np.asarray(a) * a.dtype.type(0.5)) if i in argnums else a
              for i, a in enumerate(args)]  # fmt: skip
    batched = [stack(a, b) for a, b in _strict_zip(name, "vmap arguments", args, second)]
    w2 = jax.tree_util.tree_map(lambda x: stack(x, x), w)

    @jax.jit
    def vmapped(w2, *batched):
        grads = jax.vmap(lambda c, *a: vjp_of(fn, *a)[1](c))(w2, *batched)
        return jax.vmap(fn)(*batched), grads

    got, got_g = vmapped(w2, *batched)
    want = jax.tree_util.tree_map(stack, fn(*args), fn(*second))
    _assert_close(name, "vmap value", got, want, rtol, atol)
    want_g = jax.tree_util.tree_map(stack, grads, vjp_of(fn, *second)[1](w))
    _assert_close(name, "vmap gradient", got_g, want_g, rtol, atol)


_HESSIAN_MAX = 64  # full Hessians (jacfwd of grad, hessian) up to this many entries
_LIMIT = 1e30  # stands in for +-inf when a second derivative is compared with its limit


class _SecondOrder:
    """Item 7 of the module doc: second derivatives of ``s(x) = <w, f(x)>``."""

    def __init__(self, name, fn, ref, args, argnums, key, rtol, atol):
        self.name, self.fn, self.ref = name, fn, ref
        self.args, self.argnums = args, argnums
        self.rtol, self.atol = rtol, atol
        kw, ku = _split(key, 2)
        self.kw = kw
        self.u = tuple(
            _normal(k, args[i].shape, args[i].dtype)
            for k, i in _strict_zip(name, "directions", _split(ku, len(argnums)), argnums)
        )

    def scalar(self, f, args):
        """``s(*diff) = <w, f(x)>`` with ``w`` drawn for ``f``'s outputs at ``args``."""
        outs = jax.tree_util.tree_leaves(jax.eval_shape(f, *args))
        ws = [_normal(k, o.shape, o.dtype) for k, o in zip(_split(self.kw, len(outs)), outs)]

        def s(*diff):
            leaves = jax.tree_util.tree_leaves(f(*_with(self.name, args, self.argnums, diff)))
            return sum(jnp.vdot(w, o.astype(w.dtype)) for w, o in zip(ws, leaves))

        return s

    def products(self, f, args, *, full: bool = False):
        """Jitted: the Hessian-vector products of ``s`` at ``args`` along ``u``.

        Returns ``{route: H u}`` for forward-over-reverse (``jvp of grad``) and
        reverse-over-reverse (``grad of grad``), and with ``full`` also ``jacfwd of grad``
        and ``hessian`` contracted with ``u``.
        """
        s = self.scalar(f, args)
        nums = tuple(range(len(self.argnums)))
        grad = jax.grad(s, argnums=nums)

        def contract(h, u):
            # Row block i of H times u: sum over j of H[i][j] . u[j].
            return [sum(jnp.tensordot(h[i][j], u[j], axes=u[j].ndim) for j in nums) for i in nums]

        def run(primals, u):
            g, hu = jax.jvp(lambda *d: grad(*d), primals, u)
            out = {"grad": list(g), "jvp of grad": list(hu)}

            def along(*d):
                return sum(jnp.vdot(g, v) for g, v in zip(grad(*d), u))

            out["grad of grad"] = list(jax.grad(along, argnums=nums)(*primals))
            if full:
                out["jacfwd of grad"] = contract(jax.jacfwd(grad, argnums=nums)(*primals), u)
                out["hessian"] = contract(jax.hessian(s, argnums=nums)(*primals), u)
            return out

        return jax.jit(run)(tuple(args[i] for i in self.argnums), self.u)

    def run(self, *, finite, gradient_finite, reference, finite_differences):
        # Relative to the largest entry: routes that sum in other orders differ by the
        # rounding of that entry, which cancellation leaves in the smaller ones.
        name, tol = self.name, (self.rtol * 10, max(self.rtol, self.atol) * 10)
        size = sum(int(np.prod(self.args[i].shape)) for i in self.argnums)
        got = self.products(self.fn, self.args, full=size <= _HESSIAN_MAX)
        grad, fwd = got.pop("grad"), got.pop("jvp of grad")
        if gradient_finite:
            for route, hu in [("jvp of grad", fwd), *got.items()]:
                _assert_no_nan(name, f"second order ({route})", hu)
        scale = max(1.0, max((float(np.max(np.abs(_np64(t)), initial=0)) for t in fwd), default=0))
        if not math.isfinite(scale):
            scale = 1.0
        # Where the gradient itself is infinite (entropy at p = 0) the routes may differ
        # (-inf against NaN): compared where it is finite.
        ok = [np.isfinite(np.asarray(g, np.float64)) for g in grad]
        fwd_ok = [np.where(k, np.asarray(h, np.float64), 0.0) for k, h in zip(ok, fwd)]
        for route, hu in got.items():
            hu_ok = [np.where(k, np.asarray(h, np.float64), 0.0) for k, h in zip(ok, hu)]
            _assert_close(name, f"second order: {route} against jvp of grad", hu_ok, fwd_ok,
                          tol[0], tol[1] * scale)  # fmt: skip
        if not finite:
            self.limit(grad, fwd, tol, scale)
            return
        if reference:
            # Only where the reference is finite: plain autodiff overflows in intermediate
            # products (entropy's -1/p at p = 1e-30) that the hand-written rules avoid;
            # there finite differences judge instead.
            want = self.products(self.ref, self.args)["jvp of grad"]
            want = [np.where(np.isfinite(w), w, np.asarray(g, np.float64))
                    for w, g in zip(want, fwd)]  # fmt: skip
            _assert_close(name, "second order against the reference (jvp of grad)", fwd, want,
                          tol[0], tol[1] * scale)  # fmt: skip
        if finite_differences:
            self.finite_differences()

    def limit(self, grad, fwd, tol, scale):
        """At +-inf entries: the product equals the one with +-inf replaced by +-1e30.

        Only where the gradient itself is its limit there: where an operator documents
        another convention (a fully masked row of a softmax has gradient 0, not the
        uniform limit), a zero gradient must have a zero second derivative.
        """
        near = [
            jnp.where(jnp.isinf(a), jnp.sign(a) * jnp.asarray(_LIMIT, a.dtype), a)
            if i in self.argnums
            else a
            for i, a in enumerate(self.args)
        ]
        want = self.products(self.fn, near)
        check = "second order at +-inf against its limit (+-1e30)"
        for g, g_near, hu, hu_near in zip(grad, want["grad"], fwd, want["jvp of grad"]):
            g, g_near = np.asarray(g, np.float64), np.asarray(g_near, np.float64)
            hu, hu_near = np.asarray(hu, np.float64), np.asarray(hu_near, np.float64)
            same = np.isclose(g, g_near, rtol=self.rtol, atol=self.atol, equal_nan=True)
            expected = np.where(same, hu_near, np.where(g == 0, 0.0, hu))
            _assert_close(self.name, check, hu, expected, tol[0], tol[1] * scale)

    def finite_differences(self):
        check = "second order: float64 jvp of grad against central differences of grad"
        name = self.name
        with jax.enable_x64(True):
            a64 = [jnp.asarray(a, jnp.float64) if _is_float(a) else a for a in self.args]
            u = _scaled_direction(name, self.kw, a64, self.argnums)
            s = self.scalar(self.fn, a64)
            nums = tuple(range(len(self.argnums)))
            grad = jax.grad(s, argnums=nums)

            @jax.jit
            def run(primals, u):
                def along(t):
                    return grad(*[p + t * d for p, d in zip(primals, u)])

                h = _FD_STEP
                g2, g1, m1, m2 = along(2 * h), along(h), along(-h), along(-2 * h)
                fd = [(-a + 8 * b - 8 * c + d) / (12 * h) for a, b, c, d in zip(g2, g1, m1, m2)]
                return list(jax.jvp(lambda *d: grad(*d), primals, u)[1]), fd

            hv, fd = run(tuple(a64[i] for i in self.argnums), tuple(u))
            scale = max(1.0, max(float(np.max(np.abs(_np64(t)), initial=0)) for t in hv))
            if not math.isfinite(scale):
                raise AssertionError(
                    f"check_op({name}): {check}: not finite at finite arguments; pass "
                    "finite_differences=False"
                )
            _assert_close(name, check, hv, fd, _FD_TOL[0] * 10, _FD_TOL[1] * 10 * scale)
