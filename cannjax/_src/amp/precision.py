"""Mixed-precision policies: which dtype params are stored in, computed in, returned in.

A :class:`Policy` names three floating dtypes. Training in mixed precision keeps the
*params* (and the optimizer state) in float32, runs the model's *compute* in a half
type, and returns its *output* (logits, loss) in float32::

    policy = get_policy("params=float32,compute=half,output=float32")
    logits = with_policy(model_apply, policy=policy)(params, x)

``half`` resolves per platform (:func:`half_dtype`): float16 on the configured Ascend
platform (``cannjax.backend.ascend.config().platform``), bfloat16 everywhere else. Only
floating leaves of a pytree are cast; integer, boolean and non-array leaves pass
through unchanged, so token ids and masks are safe.

cannjax's numerically sensitive operators (softmax, log_softmax, logsumexp, the norms and
the losses) accumulate in float32 internally whatever the compute dtype, so a float16
compute policy does not turn their sums into float16 sums.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from cannjax._src.core.decorators import keyword_decorator
from cannjax._src.core.platform import _facts

T = TypeVar("T")

# Name -> dtype; "half" is resolved per platform at parse time.
_DTYPE_NAMES = {
    "float16": jnp.float16,
    "f16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float32": jnp.float32,
    "f32": jnp.float32,
    "full": jnp.float32,
    "float64": jnp.float64,
    "f64": jnp.float64,
}
_KEYS = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "o": "output_dtype",
}


def half_dtype(platform: str | None = None) -> np.dtype:
    """The half-precision dtype for mixed precision on ``platform``.

    ``float16`` on Ascend, that is on the platform named by
    ``cannjax.backend.ascend.config().platform`` (``$CANNJAX_ASCEND_PLATFORM``, default
    ``"ascend"``, or set with ``cannjax.backend.ascend.configure(platform=...)``): the
    Cube unit's native input type (the 910A has no bfloat16); float16 there needs loss
    scaling (:class:`DynamicLossScale`). ``bfloat16`` on every other platform: ``cpu``
    (XLA:CPU computes float16 by converting to float32 anyway, and bfloat16 keeps
    float32's exponent range, so no loss scaling is needed), ``tpu`` (native bfloat16
    matrix units) and ``gpu``/``cuda``/``rocm`` (bfloat16 tensor cores since Ampere; on
    older GPUs such as V100 ask for ``"float16"`` explicitly). Other names (``"npu"``)
    are Ascend only when configured as its platform name.

    Args:
      platform: a platform name (case-insensitive; ``"gpu"`` means ``"cuda"``);
        ``None`` means ``jax.default_backend()``.

    Returns:
      ``numpy.dtype`` of ``jnp.bfloat16`` or ``jnp.float16``.

    Raises:
      TypeError: if ``platform`` is neither a non-empty string nor None.

    Example:
      >>> from cannjax import amp
      >>> amp.half_dtype("ascend").name, amp.half_dtype("tpu").name
      ('float16', 'bfloat16')
    """
    return _facts("cannjax.amp.half_dtype", platform).half_dtype


def _as_float_dtype(fn: str, arg: str, dtype: Any, platform: str | None = None) -> np.dtype:
    """Parses a dtype name or dtype-like into a floating numpy dtype, or raises."""
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key == "half":
            return half_dtype(platform)
        if key not in _DTYPE_NAMES:
            raise ValueError(
                f"{fn}: unknown dtype name {dtype!r} for {arg}; expected one of "
                f"{sorted(_DTYPE_NAMES) + ['half']}"
            )
        return np.dtype(_DTYPE_NAMES[key])
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{fn}: {arg} must be a floating dtype, got {dtype!r}") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"{fn}: {arg} must be a floating dtype (float16, bfloat16, float32, float64), "
            f"got {dt.name}; integer and boolean data are never cast by a policy"
        )
    return dt


def cast_floating(tree: T, dtype: Any) -> T:
    """Casts every floating leaf of ``tree`` to ``dtype``; other leaves pass unchanged.

    A leaf is floating when it has a floating ``dtype`` attribute (jax and numpy arrays
    and scalars). Integer, boolean and ``float0`` leaves, Python numbers and other
    objects are returned as they are.

    Args:
      tree: any pytree.
      dtype: the floating target dtype (a name such as ``"bf16"`` or a dtype).

    Returns:
      A pytree of the same structure.

    Raises:
      TypeError: if ``dtype`` is not floating.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax import amp
      >>> out = amp.cast_floating({"w": jnp.ones(2), "ids": jnp.arange(2)}, "float16")
      >>> out["w"].dtype.name, out["ids"].dtype.name
      ('float16', 'int32')
    """
    dt = _as_float_dtype("cannjax.amp.cast_floating", "dtype", dtype)
    return _cast_tree(tree, dt)


def _cast_tree(tree: T, dtype: np.dtype) -> T:
    def cast(x):
        x_dtype = getattr(x, "dtype", None)
        if x_dtype is None or not jnp.issubdtype(x_dtype, jnp.floating):
            return x
        if x_dtype == dtype and isinstance(x, jax.Array):
            return x
        return jnp.asarray(x, dtype=dtype)

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the dtypes of params, of compute, and of outputs.

    Attributes:
      param_dtype: dtype params (and optimizer state) are stored in; float32 in mixed
        precision training.
      compute_dtype: dtype the function computes in (inputs and params are cast to it).
      output_dtype: dtype the function's outputs are returned in.

    Raises:
      TypeError: if a dtype is not floating.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax import amp
      >>> p = amp.Policy(jnp.float32, jnp.float16, jnp.float32)
      >>> p.cast_to_compute(jnp.ones(2)).dtype.name
      'float16'
      >>> str(p)
      'params=float32,compute=float16,output=float32'
    """

    param_dtype: Any = np.dtype(jnp.float32)
    compute_dtype: Any = np.dtype(jnp.float32)
    output_dtype: Any = np.dtype(jnp.float32)

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            dt = _as_float_dtype("cannjax.amp.Policy", f, getattr(self, f))
            object.__setattr__(self, f, dt)

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to :attr:`param_dtype`."""
        return _cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to :attr:`compute_dtype`."""
        return _cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to :attr:`output_dtype`."""
        return _cast_tree(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """A copy of this policy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )


# Whole-policy presets. A single dtype name (e.g. "bf16") sets all three dtypes.
_PRESETS = {"mixed": ("float32", "half", "float32")}


def get_policy(spec: str | Policy, *, platform: str | None = None) -> Policy:
    """Parses a policy string such as ``"params=float32,compute=float16,output=float32"``.

    Grammar: comma-separated ``key=dtype`` pairs, keys ``params``/``p``, ``compute``/
    ``c``, ``output``/``o``; dtypes ``float16``/``f16``, ``bfloat16``/``bf16``,
    ``float32``/``f32``/``full``, ``float64``/``f64`` and ``half`` (resolved for
    ``platform`` by :func:`half_dtype`). Unspecified keys: params default to float32,
    compute follows params, output follows compute (jmp's convention). A bare dtype name
    (``"half"``, ``"full"``, ``"bf16"``) sets all three; ``"mixed"`` is
    ``params=float32,compute=half,output=float32``.

    Args:
      spec: the policy string (or a :class:`Policy`, returned unchanged).
      platform: platform for ``half``; ``None`` means ``jax.default_backend()``.

    Returns:
      A :class:`Policy`.

    Raises:
      ValueError: for an unknown key, dtype name or a malformed / repeated pair.
      TypeError: if ``spec`` is neither a string nor a Policy.

    Example:
      >>> from cannjax import amp
      >>> str(amp.get_policy("p=f32,c=f16"))
      'params=float32,compute=float16,output=float16'
      >>> str(amp.get_policy("mixed", platform="ascend"))
      'params=float32,compute=float16,output=float32'
    """
    fn = "cannjax.amp.get_policy"
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"{fn}: spec must be a policy string or a Policy, got {spec!r}")
    text = spec.strip().lower()
    if text in _PRESETS:
        p, c, o = (_as_float_dtype(fn, "spec", d, platform) for d in _PRESETS[text])
        return Policy(p, c, o)
    if "=" not in text:
        if text in _DTYPE_NAMES or text == "half":
            dt = _as_float_dtype(fn, "spec", text, platform)
            return Policy(dt, dt, dt)
        raise ValueError(
            f"{fn}: unknown policy {spec!r}; expected 'params=<dtype>,compute=<dtype>,"
            f"output=<dtype>' (keys p/c/o allowed), a dtype name, or one of {sorted(_PRESETS)}"
        )
    found: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(
                f"{fn}: malformed pair {part.strip()!r} in {spec!r}; expected key=dtype"
            )
        if key not in _KEYS:
            raise ValueError(
                f"{fn}: unknown key {key!r} in {spec!r}; expected params/p, compute/c or output/o"
            )
        field = _KEYS[key]
        if field in found:
            raise ValueError(f"{fn}: {field} given twice in {spec!r}")
        found[field] = _as_float_dtype(fn, key, value, platform)
    param = found.get("param_dtype", np.dtype(jnp.float32))
    compute = found.get("compute_dtype", param)
    output = found.get("output_dtype", compute)
    return Policy(param, compute, output)


@keyword_decorator
def with_policy(fun: Callable, *, policy: str | Policy) -> Callable:
    """Wraps ``fun`` to compute in the policy's compute dtype and return its output dtype.

    ``with_policy(f, policy=p)(*args, **kwargs)`` is
    ``p.cast_to_output(f(*p.cast_to_compute(args), **p.cast_to_compute(kwargs)))``.
    Only floating leaves are cast. Gradients flow through the casts: the gradient with
    respect to a float32 param of a float16 computation comes back in float32.
    Also a decorator: ``@amp.with_policy(policy="p=f32,c=f16,o=f32")``.

    Args:
      fun: the function to wrap.
      policy: a :class:`Policy` or a policy string for :func:`get_policy`, parsed when
        wrapping.

    Returns:
      The wrapped function (``functools.wraps(fun)``).

    Raises:
      TypeError: if ``fun`` is not callable or ``policy`` is not a policy.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax import amp
      >>> f = amp.with_policy(lambda w, x: x @ w, policy="p=f32,c=f16,o=f32")
      >>> y = f(jnp.ones((2, 2)), jnp.ones((1, 2)))
      >>> y.dtype.name
      'float32'
    """
    if not callable(fun):
        raise TypeError(f"cannjax.amp.with_policy: fun must be callable, got {fun!r}")
    pol = get_policy(policy)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        args, kwargs = pol.cast_to_compute((args, kwargs))
        return pol.cast_to_output(fun(*args, **kwargs))

    return wrapped
