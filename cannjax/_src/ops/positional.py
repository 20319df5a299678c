"""Position encodings: rotary position embedding (RoPE).

Shape letters (as in :func:`cannjax.ops.attention`): ``B`` batch, ``T`` length, ``N``
heads, ``H`` head dimension, ``R`` the rotated features (``rotary_dim``, even, ``<= H``).

RoPE rotates pairs of features of each query or key by an angle proportional to the
token's position. The map is linear in ``x`` and orthogonal, so its transpose is its
inverse: the backward rotates the cotangent by ``-angle``. The angles are a function of
the integer positions alone, so the forward keeps nothing but the positions and the
tangent and backward recompute ``cos`` and ``sin`` from them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.export import is_symbolic_dim
from jax.typing import ArrayLike, DTypeLike

from cannjax._src.core.dtypes import compute_dtype, upcast
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.validate import as_float, as_int

_FN = "cannjax.ops.rope"
_FREQ_FN = "cannjax.ops.rope_frequencies"

# The scaling types of Hugging Face's ``rope_scaling`` that are implemented, with the
# keys each one requires (besides "rope_type", or its older alias "type").
_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


# ------------------------------------------------------------------------------ frequencies
def _scaling_key(fn: str, scaling: Any) -> tuple | None:
    """``scaling`` (None or an HF-style ``rope_scaling`` dict) as a hashable static value:
    None (no scaling) or ``(rope_type, ((key, float), ...))`` with the keys sorted."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"{fn}: scaling must be None or a dict like Hugging Face's rope_scaling, e.g. "
            f'{{"rope_type": "linear", "factor": 4.0}}, got {type(scaling).__name__}'
        )
    params = dict(scaling)
    kinds = {params.pop(k) for k in ("rope_type", "type") if k in params}
    if len(kinds) != 1:
        raise ValueError(
            f"{fn}: scaling must name its type once, as 'rope_type' (or the older 'type'), "
            f"got {dict(scaling)!r}"
        )
    (kind,) = kinds
    if kind not in _SCALING_KEYS:
        raise ValueError(
            f"{fn}: scaling type {kind!r} is not supported; supported: "
            f"{sorted(_SCALING_KEYS)} (as in Hugging Face's rope_scaling)"
        )
    want = set(_SCALING_KEYS[kind])
    if set(params) != want:
        missing, unknown = sorted(want - set(params)), sorted(set(params) - want)
        raise ValueError(
            f"{fn}: scaling of type {kind!r} takes the keys {sorted(want)}; "
            + (f"missing {missing}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown {unknown}" if unknown else "")
        )
    for key, value in params.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)
        ):
            raise TypeError(f"{fn}: scaling[{key!r}] must be a number, got {value!r}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{fn}: scaling[{key!r}] must be finite and > 0, got {value!r}")
    if kind == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(
            f"{fn}: llama3 scaling needs high_freq_factor > low_freq_factor (the band between "
            f"them is interpolated), got high_freq_factor={params['high_freq_factor']!r} and "
            f"low_freq_factor={params['low_freq_factor']!r}"
        )
    if kind == "default":
        return None
    return kind, tuple(sorted((k, float(v)) for k, v in params.items()))


def _check_theta(fn: str, theta: Any) -> float:
    if isinstance(theta, (bool, np.bool_)) or not isinstance(
        theta, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{fn}: theta must be a Python number (static), got {theta!r}")
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"{fn}: theta must be finite and > 0 (the frequency base), got {theta!r}")
    return float(theta)


@functools.lru_cache(maxsize=256)
def _inv_freq(rotary_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """The ``[R/2]`` inverse frequencies in float64 (numpy: static constants)."""
    f = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if scaling is not None:
        kind, params = scaling
        p = dict(params)
        if kind == "linear":
            # Positional interpolation (Chen et al. 2023): positions / factor.
            f = f / p["factor"]
        else:  # llama3
            # Llama 3.1: wavelengths 2 pi / f longer than orig / low_freq_factor are
            # divided by factor (frequencies / factor), shorter than orig /
            # high_freq_factor kept, and in between interpolated linearly in orig / wavelen.
            factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            orig = p["original_max_position_embeddings"]
            wavelen = 2 * np.pi / f
            smooth = (orig / wavelen - low) / (high - low)
            mid = (1 - smooth) * f / factor + smooth * f
            f = np.where(wavelen < orig / high, f, np.where(wavelen > orig / low, f / factor, mid))
    f = np.asarray(f, np.float64)
    f.flags.writeable = False
    return f


def _check_rotary_dim(fn: str, rotary_dim: Any, head_dim: Any) -> int:
    if rotary_dim is None:
        if is_symbolic_dim(head_dim):
            raise ValueError(
                f"{fn}: the default rotary_dim = H needs a constant head dimension, but "
                f"H = x.shape[3] is symbolic ({head_dim}); pass rotary_dim explicitly"
            )
        if head_dim % 2:
            raise ValueError(
                f"{fn}: the head dimension H = x.shape[3] = {head_dim} is odd; rope rotates "
                f"pairs of features, so use an even head dimension or pass an even "
                f"rotary_dim < H (the other features pass through)"
            )
        rotary_dim = head_dim
    elif isinstance(rotary_dim, (bool, np.bool_)) or not isinstance(rotary_dim, (int, np.integer)):
        raise TypeError(f"{fn}: rotary_dim must be an int or None, got {rotary_dim!r}")
    rotary_dim = int(rotary_dim)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"{fn}: rotary_dim must be a positive even int (features are rotated in pairs), "
            f"got {rotary_dim}"
        )
    if head_dim is not None and not is_symbolic_dim(head_dim) and rotary_dim > head_dim:
        raise ValueError(
            f"{fn}: rotary_dim must be <= the head dimension H = x.shape[3] = {head_dim}, "
            f"got {rotary_dim}"
        )
    return rotary_dim


def rope_frequencies(
    rotary_dim: int,
    *,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    dtype: DTypeLike = jnp.float32,
) -> jax.Array:
    """The inverse frequencies of :func:`rope`: ``inv_freq[i] = theta^(-2i/R)``, scaled.

    Feature pair ``i`` of a token at position ``p`` is rotated by ``p * inv_freq[i]``.
    The frequencies are computed in float64 and rounded to ``dtype``; ``rope`` uses the
    same values (in float32, or float64 for float64 inputs), so code that builds its own
    ``cos``/``sin`` tables from them agrees with it.

    Scaling (``scaling``, an HF-style ``rope_scaling`` dict; ``"type"`` is accepted for
    ``"rope_type"``):

    * ``{"rope_type": "linear", "factor": f}``: ``inv_freq / f`` (positions divided by
      ``f``: positional interpolation);
    * ``{"rope_type": "llama3", "factor": s, "low_freq_factor": lo, "high_freq_factor":
      hi, "original_max_position_embeddings": L}``: with ``wavelen = 2 pi / inv_freq``,
      ``inv_freq`` is kept where ``wavelen < L / hi``, divided by ``s`` where
      ``wavelen > L / lo``, and in between ``(1 - a) inv_freq / s + a inv_freq`` with
      ``a = (L / wavelen - lo) / (hi - lo)``;
    * ``{"rope_type": "default"}``: no scaling, as None.

    Args:
      rotary_dim: ``R``, the number of rotated features: a positive even int.
      theta: the base, a positive number.
      scaling: None or a dict as above.
      dtype: a floating dtype of the result.

    Returns:
      ``[R / 2]`` array of ``dtype``.

    Raises:
      TypeError: a non-int ``rotary_dim``, a non-number ``theta`` or scaling value, a
        ``scaling`` that is not a dict, or a non-floating ``dtype``.
      ValueError: an odd or non-positive ``rotary_dim``, ``theta <= 0``, an unknown
        scaling type or key, a missing key, a non-positive scaling value, or llama3's
        ``high_freq_factor <= low_freq_factor``.

    Example:
      >>> from cannjax.ops import rope_frequencies
      >>> [float(f) for f in rope_frequencies(4, theta=100.0)]
      [1.0, 0.10000000149011612]
      >>> [float(f) for f in rope_frequencies(4, theta=100.0,
      ...                                     scaling={"rope_type": "linear", "factor": 2.0})]
      [0.5, 0.05000000074505806]

    References:
      Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
      https://arxiv.org/abs/2104.09864
      Chen et al., "Extending Context Window of Large Language Models via Positional
      Interpolation", 2023. https://arxiv.org/abs/2306.15595
      Llama Team, AI @ Meta, "The Llama 3 Herd of Models", 2024.
      https://arxiv.org/abs/2407.21783 (the scaling formula: ``apply_scaling`` in
      Meta's llama-models reference implementation, and Hugging Face transformers'
      ``rope_scaling`` of type "llama3")
    """
    if not isinstance(rotary_dim, (bool, np.bool_)) and isinstance(rotary_dim, (int, np.integer)):
        rotary_dim = _check_rotary_dim(_FREQ_FN, rotary_dim, None)
    else:
        raise TypeError(f"{_FREQ_FN}: rotary_dim must be an int, got {rotary_dim!r}")
    theta = _check_theta(_FREQ_FN, theta)
    key = _scaling_key(_FREQ_FN, scaling)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{_FREQ_FN}: dtype must be a floating dtype, got {dtype!r}")
    return jnp.asarray(_inv_freq(rotary_dim, theta, key), dtype)


# ------------------------------------------------------------------------------ rope
def _cos_sin(positions, dtype, *, rotary_dim, theta, scaling):
    """``cos`` and ``sin`` of the angles, ``[B or 1, T, 1, R/2]`` in ``dtype``."""
    f = jnp.asarray(_inv_freq(rotary_dim, theta, scaling), dtype)
    p = positions.astype(dtype)
    angle = p[..., None] * f.reshape((1,) * p.ndim + f.shape)
    if angle.ndim == 2:  # positions [T]: shared by the batch
        angle = angle[None]
    angle = angle[:, :, None, :]
    return jnp.cos(angle), jnp.sin(angle)


def _rotate(x, cos, sin, *, rotary_dim, interleaved):
    """Rotates the pairs of the first ``R`` features of ``x`` by the angle of (cos, sin):
    ``(a, b) -> (a cos - b sin, b cos + a sin)``; the other features pass through."""
    R = rotary_dim
    rot = x[..., :R]
    if interleaved:  # pairs (2i, 2i + 1)
        pairs = rot.reshape(rot.shape[:-1] + (R // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
    else:  # pairs (i, i + R/2)
        a, b = rot[..., : R // 2], rot[..., R // 2 :]
    ya, yb = a * cos - b * sin, b * cos + a * sin
    y = jnp.stack([ya, yb], -1).reshape(rot.shape) if interleaved else jnp.concatenate([ya, yb], -1)
    if R == x.shape[-1]:
        return y
    return jnp.concatenate([y, x[..., R:]], -1)


def _apply(x, positions, sign, *, rotary_dim, theta, scaling, interleaved):
    """``x`` rotated by ``sign * angle``, computed in at least float32, in ``x``'s dtype."""
    acc = compute_dtype(x.dtype)
    cos, sin = _cos_sin(positions, acc, rotary_dim=rotary_dim, theta=theta, scaling=scaling)
    sin = sin if sign > 0 else -sin
    y = _rotate(upcast(x), cos, sin, rotary_dim=rotary_dim, interleaved=interleaved)
    return y.astype(x.dtype)


def _forward(x, positions, **static):
    # Linear in x: the tangent and backward need only the angles, which the positions
    # give; keeping cos and sin ([B, T, R/2] each) would cost more than recomputing them.
    return _apply(x, positions, 1.0, **static), {"positions": positions}


def _tangent(res, t, **static):
    return _apply(t, res["positions"], 1.0, **static)  # d rope(x) = rope(dx)


def _backward(res, g, **static):
    # The rotation is orthogonal: its transpose is the rotation by -angle.
    return (_apply(g, res["positions"], -1.0, **static),)


# Jitted, so that eager calls (check_op makes many) compile each rule once per shape
# rather than each of its jnp operations; under an outer trace jit is simply inlined.
_STATIC = ("rotary_dim", "theta", "scaling", "interleaved")
_rope = defop(
    "rope",
    forward=jax.jit(_forward, static_argnames=_STATIC),
    tangent=jax.jit(_tangent, static_argnames=_STATIC),
    backward=jax.jit(_backward, static_argnames=_STATIC),
    nondiff_argnums=(1,),
    residuals={"positions": "the integer positions [T] or [B, T] (an input)"},
    level=Level.RECOMPUTE,
    reuse=(0,),
)


def _reference(x, positions, *, theta=10000.0, interleaved=False, scaling=None, rotary_dim=None):
    """Plain jnp: Hugging Face Llama's ``x cos + rotate_half(x) sin`` for the half-split
    layout, GPT-J's ``rotate_every_two`` for the interleaved one."""
    R = x.shape[-1] if rotary_dim is None else rotary_dim
    dt = compute_dtype(x.dtype)
    f = rope_frequencies(R, theta=theta, scaling=scaling, dtype=dt)
    positions = jnp.asarray(positions)
    angle = positions.astype(dt)[..., None] * f.reshape((1,) * positions.ndim + f.shape)
    angle = angle.reshape((-1,) + angle.shape[-2:])[:, :, None, :]  # [B or 1, T, 1, R/2]
    xr = x[..., :R].astype(dt)
    if interleaved:
        cos, sin = jnp.repeat(jnp.cos(angle), 2, -1), jnp.repeat(jnp.sin(angle), 2, -1)
        turned = jnp.stack([-xr[..., 1::2], xr[..., 0::2]], -1).reshape(xr.shape)
    else:
        cos = jnp.concatenate([jnp.cos(angle)] * 2, -1)
        sin = jnp.concatenate([jnp.sin(angle)] * 2, -1)
        turned = jnp.concatenate([-xr[..., R // 2 :], xr[..., : R // 2]], -1)
    y = (xr * cos + turned * sin).astype(x.dtype)
    return jnp.concatenate([y, x[..., R:]], -1)


def _sample(key):
    kx, kp = jax.random.split(key)
    x = jax.random.normal(kx, (2, 5, 3, 8), jnp.float32)
    positions = jax.random.randint(kp, (5,), 0, 64)
    return x, positions


def _edges():
    x = jax.random.normal(jax.random.key(11), (2, 4, 2, 8), jnp.float32)
    T = x.shape[1]
    big = jnp.array([1_000_000, -1_000_000, 2**24, 123_457], jnp.int32)
    return [
        # Position 0 is the identity, under every layout and scaling.
        EdgeCase((x, jnp.zeros(T, jnp.int32)), expected_value=x),
        # Large and negative positions (angles up to ~1.7e7 rad) and a zero token.
        EdgeCase((x.at[:, 1].set(0.0), big)),
        # Magnitudes far from 1 in both directions. At 1e30 the float64 finite
        # differences resolve only ~1e-6 of the terms a cos, c sin that cancel in an
        # output (a step of 1e-10 relative to x): the value and gradient are compared
        # with the reference instead.
        EdgeCase((x * 1e30, jnp.arange(T)), finite_differences=False),
        EdgeCase((x * 1e-30, jnp.arange(T))),
        # One token per sequence decoded at its own KV-cache offset: positions [B, 1].
        EdgeCase((x[:, :1], jnp.array([[4095], [17]], jnp.int32))),
    ]


_LLAMA3_SMALL = {
    # Llama 3.1's scaling with the original length reduced to 1024, so that the four
    # frequencies of an H = 8 sample fall in all three bands (kept, interpolated, divided).
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@registered(
    _rope,
    reference=_reference,
    sample=_sample,
    edges=_edges,
    configs=(
        {},
        {"interleaved": True},
        {"rotary_dim": 4},
        {"scaling": {"rope_type": "linear", "factor": 4.0}},
        {"scaling": _LLAMA3_SMALL, "interleaved": True},
    ),
)
def rope(
    x: ArrayLike,
    positions: ArrayLike,
    *,
    theta: float = 10000.0,
    interleaved: bool = False,
    scaling: Mapping[str, Any] | None = None,
    rotary_dim: int | None = None,
) -> jax.Array:
    """Rotary position embedding: rotates feature pairs by position-dependent angles.

    With ``R = rotary_dim`` and ``inv_freq = rope_frequencies(R, theta=theta,
    scaling=scaling)``, token ``t`` of sequence ``b`` has the angles
    ``angle[b, t, i] = positions[b, t] * inv_freq[i]`` (``i < R/2``) and each pair
    ``(a, c)`` of its first ``R`` features is rotated, in every head::

      a' = a cos(angle) - c sin(angle)
      c' = c cos(angle) + a sin(angle)

    Pairs are ``(i, i + R/2)`` (``interleaved=False``: the half-split layout of Hugging
    Face Llama and GPT-NeoX, ``x cos + rotate_half(x) sin``) or ``(2i, 2i + 1)``
    (``interleaved=True``: GPT-J and Meta's original Llama, the complex form
    ``(a + i c) e^(i angle)``). Features ``R..H-1`` pass through unchanged (partial
    rotary, as GPT-NeoX and Phi). The two layouts are the same map up to a permutation of
    the features: checkpoints convert between them by permuting the rows of the q and k
    projections.

    Since the rotations are orthogonal, ``rope(q, m) . rope(k, n)`` depends on the
    positions only through ``m - n``. The map is linear in ``x``: the tangent is the same
    rotation of the tangent and the backward rotates the cotangent by ``-angle``
    (``dx = R(-angle) g``), both recomputing ``cos`` and ``sin`` from the positions.
    **Residuals: the positions only** (no ``cos``/``sin`` tables, no copy of ``x``);
    second derivatives are zero.

    Angles, ``cos`` and ``sin`` are computed in float32 (float64 for float64 inputs) and
    the result is cast to ``x``'s dtype. The frequency and the angle ``positions *
    inv_freq`` are each rounded to that precision, as in the reference implementations,
    so at position ``p`` the angle is off by up to about ``p * inv_freq[i] * eps``: an
    error that grows with the position (about ``1.2e-2`` rad at ``p = 1e5`` where
    ``inv_freq = 1``, in float32). Positions beyond ``2^24`` are not exact in float32.

    Args:
      x: ``[B, T, N, H]`` floating point (queries or keys, as :func:`attention` takes
        them).
      positions: integer ``[T]`` (shared by the batch) or ``[B, T]`` (packed sequences,
        per-example offsets, KV-cache decoding); any integers, negative ones included.
        Not differentiated.
      theta: the base of the frequencies, a positive number (500000 for Llama 3).
      interleaved: pairs ``(2i, 2i + 1)`` if True, ``(i, i + R/2)`` if False.
      scaling: None or a Hugging Face ``rope_scaling`` dict for long context:
        ``{"rope_type": "linear", "factor": f}`` or ``{"rope_type": "llama3", "factor":
        8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}`` (:func:`rope_frequencies` gives the
        formulas).
      rotary_dim: ``R``, the number of leading features rotated, even and ``<= H``;
        ``H`` when None.

    Returns:
      ``[B, T, N, H]`` array of ``x``'s dtype.

    Raises:
      TypeError: a non-floating ``x``, non-integer (or boolean) ``positions``, a
        non-bool ``interleaved``, a non-int ``rotary_dim``, or a non-number ``theta``.
      ValueError: ``x`` not of rank 4; ``positions`` not ``[T]`` or ``[B, T]`` for
        ``x``'s ``B`` and ``T``; an odd head dimension (with ``rotary_dim=None``) or an
        odd, non-positive or too large ``rotary_dim``; ``theta <= 0``; an unknown scaling
        type or key, a missing key or a non-positive scaling value.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.ops import rope
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> y = rope(x, jnp.arange(3))
      >>> y.shape, bool(jnp.allclose(y[:, 0], x[:, 0]))  # position 0: unchanged
      ((1, 3, 2, 4), True)
      >>> bool(jnp.allclose(rope(y, -jnp.arange(3)), x, atol=1e-6))  # inverse rotation
      True
      >>> g = jax.grad(lambda x: rope(x, jnp.arange(3)).sum())(x)
      >>> g.shape
      (1, 3, 2, 4)

    References:
      Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
      https://arxiv.org/abs/2104.09864
      Chen et al., "Extending Context Window of Large Language Models via Positional
      Interpolation", 2023 (linear scaling). https://arxiv.org/abs/2306.15595
      Llama Team, AI @ Meta, "The Llama 3 Herd of Models", 2024 (llama3 scaling).
      https://arxiv.org/abs/2407.21783
      Huawei CANN operator RotaryPositionEmbedding
    """
    x = as_float(_FN, "x", x)
    if x.ndim != 4:
        raise ValueError(f"{_FN}: x must have rank 4 ([B, T, N, H]), got shape {x.shape}")
    B, T, _, H = x.shape
    positions = as_int(_FN, "positions", positions)
    if positions.shape not in ((T,), (B, T)):
        raise ValueError(
            f"{_FN}: positions must have shape [T] = ({T},) or [B, T] = ({B}, {T}) for x of "
            f"shape {x.shape}, got {positions.shape}"
        )
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"{_FN}: interleaved must be a bool, got {interleaved!r}")
    rotary_dim = _check_rotary_dim(_FN, rotary_dim, H)
    theta = _check_theta(_FN, theta)
    key = _scaling_key(_FN, scaling)
    return _rope(
        x,
        positions,
        rotary_dim=rotary_dim,
        theta=theta,
        scaling=key,
        interleaved=bool(interleaved),
    )


# ------------------------------------------------------------------------------ apply_rope
_APPLY_FN = "cannjax.ops.apply_rope"


def _apply_tables(x, cos, sin, *, interleaved):
    """``x`` with its first ``R = 2 * cos.shape[-1]`` features rotated by (cos, sin), in at
    least float32, returned in ``x``'s dtype."""
    acc = compute_dtype(x.dtype)
    R = 2 * cos.shape[-1]
    cos, sin = (_to_rank(t, x.ndim).astype(acc) for t in (cos, sin))
    y = _rotate(upcast(x), cos, sin, rotary_dim=R, interleaved=interleaved)
    return y.astype(x.dtype)


def _broadcasts_to(shape, want) -> bool:
    """Whether ``shape`` broadcasts to ``want`` by numpy's rules (symbolic sizes too)."""
    # Symbolic sizes compare equal only when provably equal (``b == t`` is False).
    return len(shape) <= len(want) and all(
        d == 1 or d == w for d, w in zip(shape[::-1], want[::-1])
    )


def _to_rank(t, ndim):
    """``t`` with leading unit axes up to rank ``ndim`` (numpy's broadcasting, written
    out, so that programs that raise on rank promotion run)."""
    return t.reshape((1,) * (ndim - t.ndim) + t.shape)


def _tables_forward(x, cos, sin, *, interleaved):
    # Linear in x: the tangent and the backward need the tables only, never x.
    y = _apply_tables(x, cos, sin, interleaved=interleaved)
    return y, {"cos": cos, "sin": sin}


def _tables_tangent(res, t, *, interleaved):
    return _apply_tables(t, res["cos"], res["sin"], interleaved=interleaved)


def _tables_backward(res, g, *, interleaved):
    # The transpose of [[c, -s], [s, c]] is [[c, s], [-s, c]]: the same map with -sin
    # (for any tables, rotations or not).
    return (_apply_tables(g, res["cos"], -res["sin"], interleaved=interleaved),)


_apply_rope = defop(
    "apply_rope",
    forward=jax.jit(_tables_forward, static_argnames=("interleaved",)),
    tangent=jax.jit(_tables_tangent, static_argnames=("interleaved",)),
    backward=jax.jit(_tables_backward, static_argnames=("interleaved",)),
    nondiff_argnums=(1, 2),
    residuals={
        "cos": "the cos table as given (an input, broadcastable to [..., R/2])",
        "sin": "the sin table as given (an input)",
    },
    level=Level.RECOMPUTE,
    reuse=(0,),
)


def _tables_reference(x, cos, sin, *, interleaved=False):
    """Plain jnp, as Hugging Face writes it: ``x cos + rotate_half(x) sin`` with the
    tables repeated to ``R`` features (``rotate_every_two`` for the interleaved layout)."""
    dt = compute_dtype(x.dtype)
    h = cos.shape[-1]
    R = 2 * h
    xr = x[..., :R].astype(dt)
    c, s = _to_rank(cos, x.ndim).astype(dt), _to_rank(sin, x.ndim).astype(dt)
    if interleaved:
        c, s = jnp.repeat(c, 2, -1), jnp.repeat(s, 2, -1)
        turned = jnp.stack([-xr[..., 1::2], xr[..., 0::2]], -1).reshape(xr.shape)
    else:
        c, s = jnp.concatenate([c, c], -1), jnp.concatenate([s, s], -1)
        turned = jnp.concatenate([-xr[..., h:], xr[..., :h]], -1)
    y = (xr * c + turned * s).astype(x.dtype)
    return jnp.concatenate([y, x[..., R:]], -1)


def _tables_sample(key):
    kx, kp = jax.random.split(key)
    x = jax.random.normal(kx, (2, 5, 3, 8), jnp.float32)
    angle = jax.random.uniform(kp, (5, 1, 4), jnp.float32, -3.0, 3.0)  # [T, 1, R/2]
    # Scaled as YaRN scales its tables (cos and sin times an attention factor).
    return x, 1.1 * jnp.cos(angle), 1.1 * jnp.sin(angle)


def _tables_edges():
    x = jax.random.normal(jax.random.key(12), (2, 4, 2, 8), jnp.float32)
    ones, zeros = jnp.ones((4, 1, 4)), jnp.zeros((4, 1, 4))
    angle = jnp.linspace(-1e6, 1e6, 16).reshape(4, 1, 4)
    return [
        # cos = 1, sin = 0 is the identity.
        EdgeCase((x, ones, zeros), expected_value=x),
        # Huge angles (tables computed outside, so exact) and a zero token.
        EdgeCase((x.at[:, 1].set(0.0), jnp.cos(angle), jnp.sin(angle))),
        # Magnitudes far from 1 (see rope's edges for why 1e30 skips differences).
        EdgeCase((x * 1e30, jnp.cos(angle), jnp.sin(angle)), finite_differences=False),
        EdgeCase((x * 1e-30, jnp.cos(angle), jnp.sin(angle))),
        # Tables of one row per sequence ([B, T, 1, R/2]), partial rotary (R = 4 < H).
        EdgeCase(
            (
                x,
                jnp.cos(angle[None, :, :, :2] * jnp.ones((2, 1, 1, 1))),
                jnp.sin(angle[None, :, :, :2] * jnp.ones((2, 1, 1, 1))),
            )
        ),
    ]


@registered(
    _apply_rope,
    reference=_tables_reference,
    sample=_tables_sample,
    edges=_tables_edges,
    configs=({}, {"interleaved": True}),
)
def apply_rope(x: ArrayLike, cos: ArrayLike, sin: ArrayLike, *, interleaved: bool = False):
    """Rotary position embedding from given ``cos`` and ``sin`` tables.

    The rotation of :func:`rope`, with the tables computed by the caller (Hugging Face's
    ``apply_rotary_pos_emb(q, k, cos, sin)``, tables scaled as YaRN scales them, tables
    cached across steps). With ``h = cos.shape[-1]`` and ``R = 2h``, each pair ``(a, c)`` of
    the first ``R`` features of ``x`` becomes::

      a' = a cos - c sin
      c' = c cos + a sin

    pairs ``(i, i + h)`` (``interleaved=False``, ``x cos + rotate_half(x) sin`` with the
    tables repeated to ``R`` features) or ``(2i, 2i + 1)`` (``interleaved=True``); features
    ``R..`` pass through. The map is linear in ``x`` for any tables, rotations or not: the
    backward applies its transpose, the same map with ``-sin``. **Residuals: the two
    tables as given** (``h`` features each, not the ``R`` of repeated tables, and no copy
    of ``x``). The tables are not differentiated (like :func:`rope`'s positions): compute
    them from positions, not from parameters you train.

    Computed in float32 (float64 for float64 ``x``), returned in ``x``'s dtype.

    Args:
      x: ``[..., H]`` floating point, features last (``[B, T, N, H]`` as
        :func:`attention` takes queries and keys).
      cos: ``[..., h]`` floating point, broadcastable against ``x[..., :h]`` (numpy
        rules, from the right: ``[T, 1, h]`` or ``[B, T, 1, h]`` for ``[B, T, N, H]``
        queries), ``2h <= H``.
      sin: as ``cos``, the same shape.
      interleaved: pairs ``(2i, 2i + 1)`` if True, ``(i, i + h)`` if False.

    Returns:
      ``x``'s shape and dtype.

    Raises:
      TypeError: non-floating ``x``, ``cos`` or ``sin``; a non-bool ``interleaved``.
      ValueError: ``cos`` and ``sin`` of different shapes, of rank 0 or above ``x``'s,
        ``2 * cos.shape[-1]`` above ``x``'s last dimension, or not broadcastable against
        ``x[..., :h]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.ops import apply_rope, rope, rope_frequencies
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> angle = jnp.arange(3.0)[:, None, None] * rope_frequencies(4)[None, None]  # [T, 1, 2]
      >>> y = apply_rope(x, jnp.cos(angle), jnp.sin(angle))
      >>> bool(jnp.allclose(y, rope(x, jnp.arange(3)), atol=1e-6))
      True
    """
    x = as_float(_APPLY_FN, "x", x)
    cos = as_float(_APPLY_FN, "cos", cos)
    sin = as_float(_APPLY_FN, "sin", sin)
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"{_APPLY_FN}: interleaved must be a bool, got {interleaved!r}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"{_APPLY_FN}: cos and sin must have the same shape, got {cos.shape} and {sin.shape}"
        )
    if x.ndim == 0 or not 1 <= cos.ndim <= x.ndim:
        raise ValueError(
            f"{_APPLY_FN}: cos must have rank 1 to x.ndim = {x.ndim} (features last), got "
            f"shape {cos.shape} for x of shape {x.shape}"
        )
    h = cos.shape[-1]
    if 2 * h > x.shape[-1] or h < 1:
        raise ValueError(
            f"{_APPLY_FN}: cos.shape[-1] = {h} pairs need 2 * {h} <= x.shape[-1] = "
            f"{x.shape[-1]} features"
        )
    want = (*x.shape[:-1], h)
    if not _broadcasts_to(cos.shape, want):
        raise ValueError(
            f"{_APPLY_FN}: cos and sin of shape {cos.shape} do not broadcast against "
            f"x[..., :{h}] of shape {want} (numpy rules, from the right: for queries "
            f"[B, T, N, H] use [T, 1, {h}] or [B, T, 1, {h}])"
        )
    return _apply_rope(x, cos, sin, interleaved=bool(interleaved))
