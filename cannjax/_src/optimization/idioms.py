"""The idioms ``optimize`` recognizes by template, and the operator each becomes.

Each template computes an idiom the way a library or a user writes it: ``jax.nn``'s
activations and softmax family, flax's and equinox's layer and RMS norms, optax's
cross-entropies, ``jnp.linalg.norm``, and the same written out in ``jnp``. Templates that
need flax or equinox are built only when those are installed (then the user's code may
call them). Matching is :func:`cannjax._src.optimization.match.match`: a match proves that
the user's equations compute the template's function of the bound inputs.

Dense layers and attention vary in layout (``x @ w`` or ``w @ x`` under ``vmap``, heads
first or last) more than templates can enumerate; they are matched structurally in
:mod:`cannjax._src.optimization.finders.dense`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cannjax import ops
from cannjax._src.optimization.replacement import Kind

# Values no user writes: a template literal equal to one captures the user's value there
# (an eps, an attention scale). Each is exact in float32, so the template's literal is it.
EPS = 3.35693359375e-05
SCALE = 0.123046875
PLACEHOLDERS = frozenset({EPS, SCALE})


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One template of an idiom, at guessed input avals.

    Attributes:
      source: where the template's code comes from (``"jax.nn.gelu"``), for reports.
      fn: ``fn(*inputs, **statics)`` computes the idiom.
      avals: guessed input avals (shapes are refined by the exact pass).
      statics: static arguments of ``fn``; one set to a value of :data:`PLACEHOLDERS`
        takes the user's value found at that place.
      replace: ``replace(*inputs, **statics)`` computes the same with cannjax operators.
    """

    source: str
    fn: Callable[..., Any]
    avals: tuple
    statics: tuple = ()
    replace: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class Idiom:
    """A family of templates that become the same cannjax operator."""

    name: Kind  # what it computes, for reports
    op: str  # the cannjax operator it becomes
    anchors: frozenset  # primitive names the template's last equation may have
    candidates: Callable[[Any], Iterator[Candidate]]  # from the anchor's output aval
    near: Near | None = None  # a cheap filter before any template is traced


@dataclasses.dataclass(frozen=True)
class Near:
    """One of ``primitives`` must be at most ``depth`` equations upstream of an idiom's
    last equation (itself at 0) before its templates are traced; ``why``: where the
    templates put it, which is what the depth is read from."""

    primitives: frozenset
    depth: int
    why: str


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


# ---------------------------------------------------------------------- activations
def _hand_gelu(x):
    return 0.5 * x * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _silu_hand(x):
    return x * jax.nn.sigmoid(x)


def _relu_hand(x):
    return jnp.maximum(x, 0)


_gelu_tanh_template = functools.partial(jax.nn.gelu, approximate=True)
_gelu_erf_template = functools.partial(jax.nn.gelu, approximate=False)


def _unary(source, fn, replace):
    def candidates(aval):
        if _float(aval):
            yield Candidate(source, fn, (_sds(aval.shape, aval.dtype),), (), replace)

    return candidates


def _chain(*gens):
    def candidates(aval):
        for g in gens:
            yield from g(aval)

    return candidates


_gelu_tanh = functools.partial(ops.gelu, approximate=True)
_gelu_erf = functools.partial(ops.gelu, approximate=False)

ACTIVATIONS = (
    Idiom(
        Kind.ACTIVATION,
        "gelu",
        frozenset({"mul", "copy"}),
        _chain(
            _unary("jax.nn.gelu", _gelu_tanh_template, _gelu_tanh),
            _unary("jax.nn.gelu", _gelu_erf_template, _gelu_erf),
            _unary("jnp (tanh form)", _hand_gelu, _gelu_tanh),
        ),
        near=Near(
            frozenset({"tanh", "erf", "erfc"}),
            depth=4,
            why="0.5 x (1 + tanh(.)) puts the tanh (erf) 3 above the product; jax adds a copy",
        ),
    ),
    Idiom(
        Kind.ACTIVATION,
        "silu",
        frozenset({"mul"}),
        _chain(
            _unary("jax.nn.silu", jax.nn.silu, ops.silu),
            _unary("jnp (x * sigmoid(x))", _silu_hand, ops.silu),
        ),
        near=Near(frozenset({"logistic"}), depth=2, why="x * logistic(x), maybe a copy after"),
    ),
    Idiom(
        Kind.ACTIVATION,
        "log_sigmoid",
        frozenset({"neg", "sub", "custom_jvp_call", "mul"}),
        _unary("jax.nn.log_sigmoid", jax.nn.log_sigmoid, ops.log_sigmoid),
        near=Near(
            frozenset({"log1p", "exp", "logistic", "log", "custom_jvp_call"}),
            depth=4,
            why="-softplus(-x): log1p(exp(-|x|)) under a negation and jax's select",
        ),
    ),
    Idiom(
        Kind.ACTIVATION,
        "softplus",
        frozenset({"logaddexp", "add", "custom_jvp_call", "log1p", "select_n", "max"}),
        _unary("jax.nn.softplus", jax.nn.softplus, ops.softplus),
        near=Near(
            frozenset({"log1p", "exp", "logaddexp", "custom_jvp_call"}),
            depth=4,
            why="log1p(exp(-|x|)) + max(x, 0): the log1p is at most 4 above the sum",
        ),
    ),
    Idiom(
        Kind.ACTIVATION,
        "relu",
        frozenset({"custom_jvp_call", "max"}),
        _chain(
            _unary("jax.nn.relu", jax.nn.relu, ops.relu),
            _unary("jnp.maximum(x, 0)", _relu_hand, ops.relu),
        ),
    ),
    Idiom(
        Kind.ACTIVATION,
        "sigmoid",
        frozenset({"logistic"}),
        _unary("jax.nn.sigmoid", jax.nn.sigmoid, ops.sigmoid),
    ),
    Idiom(Kind.ACTIVATION, "tanh", frozenset({"tanh"}), _unary("jnp.tanh", jnp.tanh, ops.tanh)),
)


# ---------------------------------------------------------------------- softmax family
def _hand_softmax(x, axis):
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def _hand_softmax_sg(x, axis):
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def _softmax_where(x, w, axis):
    return jax.nn.softmax(x, axis=axis, where=w)


def _ops_softmax_where(x, w, axis):
    return ops.softmax(x, axis=axis, where=w)


def _softmax_candidates(aval):
    if not _float(aval) or aval.ndim == 0:
        return
    x = _sds(aval.shape, aval.dtype)
    mask = _sds(aval.shape, jnp.bool_)
    for axis in range(aval.ndim):
        s = (("axis", axis),)
        yield Candidate("jax.nn.softmax", jax.nn.softmax, (x,), s, ops.softmax)
        yield Candidate("jax.nn.softmax(where=)", _softmax_where, (x, mask), s, _ops_softmax_where)
        yield Candidate("jnp (max-shifted)", _hand_softmax, (x,), s, ops.softmax)
        yield Candidate("jnp (max-shifted)", _hand_softmax_sg, (x,), s, ops.softmax)


def _log_softmax_candidates(aval):
    if not _float(aval) or aval.ndim == 0:
        return
    x = _sds(aval.shape, aval.dtype)
    for axis in range(aval.ndim):
        s = (("axis", axis),)
        yield Candidate("jax.nn.log_softmax", jax.nn.log_softmax, (x,), s, ops.log_softmax)


def _logsumexp_all(x):
    return jax.nn.logsumexp(x)


def _logsumexp_candidates(aval):
    if not _float(aval):
        return
    if aval.ndim == 0:  # over every axis (jax.nn's default)
        for rank in (1, 2, 3):
            x = _sds((2, 3, 4)[:rank], aval.dtype)
            yield Candidate("jax.nn.logsumexp", _logsumexp_all, (x,), (), ops.logsumexp)
    for axis in range(aval.ndim + 1):
        shape = (*aval.shape[:axis], 8, *aval.shape[axis:])
        yield Candidate(
            "jax.nn.logsumexp",
            jax.nn.logsumexp,
            (_sds(shape, aval.dtype),),
            (("axis", axis),),
            ops.logsumexp,
        )
    # keepdims=True: the reduced axis stays, of size 1
    for axis in (a for a in range(aval.ndim) if aval.shape[a] == 1):
        shape = (*aval.shape[:axis], 8, *aval.shape[axis + 1 :])
        yield Candidate(
            "jax.nn.logsumexp",
            jax.nn.logsumexp,
            (_sds(shape, aval.dtype),),
            (("axis", axis), ("keepdims", True)),
            ops.logsumexp,
        )


_EXP, _LOG, _SQRT = frozenset({"exp"}), frozenset({"log"}), frozenset({"rsqrt", "sqrt"})
# jax.nn.softmax(where=) ends with the select of its where.
SOFTMAX = Idiom(
    name=Kind.SOFTMAX,
    op="softmax",
    anchors=frozenset({"div", "select_n"}),
    candidates=_softmax_candidates,
    near=Near(_EXP, depth=3, why="exp / sum(exp): 1 above the div, 3 under where='s select"),
)
SOFTMAXES = (
    SOFTMAX,
    Idiom(
        name=Kind.SOFTMAX,
        op="log_softmax",
        anchors=frozenset({"sub"}),
        candidates=_log_softmax_candidates,
        near=Near(_LOG, depth=2, why="s - log(sum exp s): 1 above the sub, 2 with a broadcast"),
    ),
    Idiom(
        name=Kind.SOFTMAX,
        op="logsumexp",
        anchors=frozenset({"add"}),
        candidates=_logsumexp_candidates,
        near=Near(_LOG, depth=2, why="log(sum exp) + max: 1 above the add, 2 with a broadcast"),
    ),
)


# ---------------------------------------------------------------------- norms
def _layer_norm_hand(x, scale, bias, *, eps):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
    lead = (1,) * (x.ndim - 1)
    return (x - m) * jax.lax.rsqrt(v + eps) * scale.reshape(lead + scale.shape) + bias.reshape(
        lead + bias.shape
    )


def _layer_norm_broadcast(x, scale, bias, *, eps):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * scale + bias


def _layer_norm_bare(x, scale, bias, *, eps):
    del scale, bias  # no affine part: the same inputs as the other templates
    m = jnp.mean(x, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(jnp.mean(jnp.square(x - m), -1, keepdims=True) + eps)


def _layer_norm_var(x, scale, bias, *, eps):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.var(x, -1, keepdims=True)
    return (x - m) / jnp.sqrt(v + eps) * scale + bias


def _rms_norm_hand(x, scale, bias, *, eps):
    del bias  # the same inputs as the other norm templates
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps) * scale


def _linen_norm(kind, x, scale, bias, *, eps, use_scale, use_bias):
    from flax import linen

    params = {}
    if use_scale:
        params["scale"] = scale
    if use_bias:
        params["bias"] = bias
    if kind == "layer":
        mod = linen.LayerNorm(epsilon=eps, use_scale=use_scale, use_bias=use_bias)
    else:
        mod = linen.RMSNorm(epsilon=eps, use_scale=use_scale)
    return mod.apply({"params": params}, x)


@functools.lru_cache(maxsize=64)
def _nnx_split(kind, d, eps, use_scale, use_bias):
    from flax import nnx

    def make():
        rngs = nnx.Rngs(0)
        if kind == "layer":
            return nnx.LayerNorm(d, epsilon=eps, use_scale=use_scale, use_bias=use_bias, rngs=rngs)
        return nnx.RMSNorm(d, epsilon=eps, use_scale=use_scale, rngs=rngs)

    # Abstract parameters: the template replaces them, so nothing is computed here.
    return nnx.split(nnx.eval_shape(make))


def _nnx_norm(kind, x, scale, bias, *, eps, use_scale, use_bias):
    from flax import nnx

    graphdef, state = _nnx_split(kind, x.shape[-1], eps, use_scale, use_bias)
    values = {"scale": scale, "bias": bias}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    new = [values[_last_key(path)] for path, _ in leaves]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, new))(x)


def _last_key(path) -> str:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return next(n for n in reversed(names) if n in ("scale", "bias"))


def _eqx_norm(kind, x, scale, bias, *, eps, use_scale, use_bias):
    import equinox as eqx

    d = x.shape[-1]
    cls = eqx.nn.LayerNorm if kind == "layer" else eqx.nn.RMSNorm
    mod = eqx.filter_eval_shape(cls, d, eps=eps, use_weight=use_scale, use_bias=use_bias)
    if use_scale:
        mod = eqx.tree_at(lambda m: m.weight, mod, scale)
    if use_bias:
        mod = eqx.tree_at(lambda m: m.bias, mod, bias)
    f = mod
    for _ in range(x.ndim - 1):
        f = jax.vmap(f)
    return f(x)


# One object per template function: the template cache is keyed by it.
_LIBRARY_NORMS = {
    (kind, lib): functools.partial(fn, kind)
    for kind in ("layer", "rms")
    for lib, fn in (("nnx", _nnx_norm), ("linen", _linen_norm), ("eqx", _eqx_norm))
}


@functools.cache
def _installed(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def _norm_replacement(kind, use_scale, use_bias):
    def replace(x, scale, bias, *, eps, **_):
        d = x.shape[-1]
        scale = scale if use_scale else jnp.ones((d,), x.dtype)
        if kind == "layer":
            bias = bias if use_bias else jnp.zeros((d,), x.dtype)
            return ops.layer_norm(x, scale, bias, eps=eps)
        y = ops.rms_norm(x, scale, eps=eps)
        return y + bias if use_bias else y

    return replace


def _norm_candidates(kind):
    def candidates(aval):
        if not _float(aval) or aval.ndim == 0:
            return
        d = aval.shape[-1]
        x, p = _sds(aval.shape, aval.dtype), _sds((d,), aval.dtype)
        flags = [(True, True), (True, False), (False, True), (False, False)]
        libs = []
        if _installed("flax"):
            libs += [
                ("flax.nnx", _LIBRARY_NORMS[kind, "nnx"]),
                ("flax.linen", _LIBRARY_NORMS[kind, "linen"]),
            ]
        if _installed("equinox"):
            libs.append(("equinox.nn", _LIBRARY_NORMS[kind, "eqx"]))
        for source, fn in libs:
            for use_scale, use_bias in flags:
                if kind == "rms" and use_bias and source != "equinox.nn":
                    continue
                statics = (("eps", EPS), ("use_bias", use_bias), ("use_scale", use_scale))
                rep = _norm_replacement(kind, use_scale, use_bias)
                yield Candidate(source, fn, (x, p, p), statics, rep)
        if kind == "layer":
            rep = _norm_replacement("layer", True, True)
            yield Candidate("jnp (mean, rsqrt)", _layer_norm_hand, (x, p, p), (("eps", EPS),), rep)
            yield Candidate("jnp (var, sqrt)", _layer_norm_var, (x, p, p), (("eps", EPS),), rep)
            yield Candidate(
                "jnp (mean, rsqrt)", _layer_norm_broadcast, (x, p, p), (("eps", EPS),), rep
            )
            bare = _norm_replacement("layer", False, False)
            yield Candidate("jnp (mean, rsqrt)", _layer_norm_bare, (x, p, p), (("eps", EPS),), bare)
        else:
            rep = _norm_replacement("rms", True, False)
            yield Candidate(
                "jnp (mean of squares)",
                _rms_norm_hand,
                (x, p, p),
                (("eps", EPS),),
                rep,
            )

    return candidates


def _l2(x):
    return jnp.linalg.norm(x, axis=-1)


def _ops_l2(x):
    return ops.norm(x, axis=-1)


def _l2_all(x):
    return jnp.linalg.norm(x)


def _ops_l2_all(x):
    return ops.norm(x.reshape(-1), axis=-1)


def _l2_candidates(aval):
    if not _float(aval):
        return
    if aval.ndim == 0:  # the vector or Frobenius norm of the whole array
        for rank in (1, 2):
            x = _sds((2, 3)[:rank], aval.dtype)
            yield Candidate("jnp.linalg.norm", _l2_all, (x,), (), _ops_l2_all)
    shape = (*aval.shape, 8)
    yield Candidate("jnp.linalg.norm", _l2, (_sds(shape, aval.dtype),), (), _ops_l2)


# Half inputs: statistics in float32, then a cast back (flax, equinox).
_NORM_ANCHORS = frozenset({"add", "mul", "convert_element_type"})
_NORM_ROOT = Near(
    _SQRT,
    depth=5,
    why="rsqrt(var + eps), then * x (or / sqrt), * scale, + bias and a cast back: 5 at most",
)
NORMS = (
    Idiom(
        name=Kind.NORM,
        op="layer_norm",
        anchors=_NORM_ANCHORS | {"div"},
        candidates=_norm_candidates("layer"),
        near=_NORM_ROOT,
    ),
    Idiom(
        name=Kind.NORM,
        op="rms_norm",
        anchors=_NORM_ANCHORS,
        candidates=_norm_candidates("rms"),
        near=_NORM_ROOT,
    ),
    Idiom(Kind.NORM, "norm", frozenset({"sqrt", "custom_jvp_call", "pjit", "jit"}), _l2_candidates),
)


# ---------------------------------------------------------------------- losses
def wrap_labels(labels, classes):
    # optax indexes with take_along_axis: a label in [-C, 0) counts from the end.
    return jnp.where(labels < 0, labels + classes, labels)


def _ce_integer(logits, labels):
    return ops.softmax_cross_entropy(logits, labels)


def _logp_take_template(logits, idx):
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), idx, axis=-1)


def _logp_take_replace(logits, idx):
    return -ops.softmax_cross_entropy(logits, idx[..., 0])[..., None]


def _loss_candidates(aval):
    if not _float(aval):
        return
    logits = _sds((*aval.shape, 8), aval.dtype)
    labels = _sds(aval.shape, jnp.int32)
    yield Candidate(
        "optax.softmax_cross_entropy_with_integer_labels",
        optax.softmax_cross_entropy_with_integer_labels,
        (logits, labels),
        (),
        _ce_integer,
    )


def _logp_take_candidates(aval):
    if not _float(aval) or aval.ndim == 0 or aval.shape[-1] != 1:
        return
    logits = _sds((*aval.shape[:-1], 8), aval.dtype)
    idx = _sds(aval.shape, jnp.int32)
    yield Candidate(
        "jax.nn.log_softmax + take_along_axis",
        _logp_take_template,
        (logits, idx),
        (),
        _logp_take_replace,
    )


_LOSS_LOG = Near(
    _LOG,
    depth=4,
    why="the log of logsumexp / log_softmax, then the label's logit subtracted or gathered",
)
CROSS_ENTROPY = Idiom(
    name=Kind.LOSS,
    op="softmax_cross_entropy",
    anchors=frozenset({"sub", "neg", "mul"}),
    candidates=_loss_candidates,
    near=_LOSS_LOG,
)
LOSSES = (
    CROSS_ENTROPY,
    Idiom(
        name=Kind.LOSS,
        op="softmax_cross_entropy",
        anchors=frozenset({"gather"}),
        candidates=_logp_take_candidates,
        near=_LOSS_LOG,
    ),
)


# ---------------------------------------------------------------------- attention
def _jax_attention(q, k, v, *, scale, is_causal):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal)


def _ops_attention(q, k, v, *, scale, is_causal):
    return ops.attention(q, k, v, scale=scale, causal=is_causal)


def _attention_candidates(aval):
    # Masked and causal forms are also found structurally (finders/attention.py);
    # jax's path without a mask computes its softmax around transposes that only this
    # template, traced from jax itself, follows.
    if not _float(aval) or aval.ndim != 4:
        return
    x = _sds(aval.shape, aval.dtype)
    for causal in (False, True):
        statics = (("is_causal", causal), ("scale", SCALE))
        source = "jax.nn.dot_product_attention"
        yield Candidate(source, _jax_attention, (x, x, x), statics, _ops_attention)


ATTENTION = Idiom(
    name=Kind.ATTENTION,
    op="attention",
    anchors=frozenset({"reshape"}),
    candidates=_attention_candidates,
    near=Near(_EXP, depth=8, why="jax's softmax exp, then p v, its transposes and reshape"),
)
