"""Ascend: the CANN kernel table, its platform name, and what JAX needs to export it.

Every Ascend setting is made here. The platform name itself is kept with the other
platform facts (``cannjax._src.core.platform``), so that amp's half dtype and overflow
check, ``cannjax.backend.info()`` and this table always agree on which platform is
Ascend; :func:`configure` changes it there.

cannjax's Ascend kernels are calls of FFI targets named after CANN's ``aclnn``
operators, forward and backward separately, as CANN pairs each operator with its
gradient operator (``aclnnGeluV2`` / ``aclnnGeluBackwardV2(gradOutput, self)``). A PJRT
plugin for Ascend must register FFI handlers under these names (or the names given to
:func:`configure`) for its platform; the calling convention of each target is listed in
:data:`TARGET_SIGNATURES`.

Example:
  >>> import cannjax
  >>> cfg = cannjax.backend.ascend.config()
  >>> cfg.platform, cfg.targets["gelu.forward"], cfg.targets["gelu.backward"]
  ('ascend', 'aclnnGeluV2', 'aclnnGeluBackwardV2')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import numpy as np

from cannjax._src.core import kernels
from cannjax._src.core.kernels import _check_platform
from cannjax._src.core.platform import ascend_platform, set_ascend_platform

KERNELS_ENV = "CANNJAX_ASCEND_KERNELS"


# "<op>.<rule>" -> FFI target name (the CANN aclnn kernel it stands for).
class TargetTable(Mapping):
    """A read-only table keyed by ``"<op>.<rule>"`` (e.g. ``"gelu.backward"``)."""

    def __init__(self, entries: Mapping[str, str]):
        self._entries = dict(entries)

    def __getitem__(self, key: str) -> str:
        return self._entries[key]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TargetTable({self._entries!r})"


DEFAULT_TARGETS = TargetTable(
    {
        "gelu.forward": "aclnnGeluV2",
        "gelu.backward": "aclnnGeluBackwardV2",
        "silu.forward": "aclnnSilu",
        "silu.backward": "aclnnSiluBackward",
        "sigmoid.forward": "aclnnSigmoid",
        "sigmoid.backward": "aclnnSigmoidBackward",
        "tanh.forward": "aclnnTanh",
        "tanh.backward": "aclnnTanhBackward",
        "exp.forward": "aclnnExp",
        "exp.backward": "aclnnMul",
        "relu.forward": "aclnnRelu",
        "softplus.forward": "aclnnSoftplus",
    }
)

# What each target receives (operands, then FFI attributes) and returns: the contract a
# plugin's handlers implement. Shapes and dtypes of all operands and results are equal.
TARGET_SIGNATURES = TargetTable(
    {
        "gelu.forward": "(x; approximate: i64 0=erf 1=tanh) -> y",
        "gelu.backward": "(dy, x; approximate: i64) -> dx",
        "silu.forward": "(x) -> y",
        "silu.backward": "(dy, x) -> dx",
        "sigmoid.forward": "(x) -> y",
        "sigmoid.backward": "(dy, y) -> dx",
        "tanh.forward": "(x) -> y",
        "tanh.backward": "(dy, y) -> dx",
        "exp.forward": "(x) -> y",
        "exp.backward": "(dy, y) -> dy * y",
        "relu.forward": "(x) -> y",
        "softplus.forward": "(x; beta: f32 = 1, threshold: f32 = 20) -> y",
    }
)


@dataclasses.dataclass(frozen=True)
class AscendConfig:
    """The Ascend settings in force.

    Attributes:
      platform: the lowering platform name of Ascend devices (what the PJRT plugin's
        devices report as ``device.platform``): the name given to :func:`configure`,
        else ``$CANNJAX_ASCEND_PLATFORM``, else ``"ascend"``. Every per-platform default
        (``cannjax.amp.half_dtype``, ``cannjax.amp.default_overflow_check``,
        ``cannjax.backend.facts``...) treats this platform, and only this one,
        as Ascend.
      targets: ``"<op>.<rule>"`` -> FFI target name; see :data:`DEFAULT_TARGETS`.
      enabled: whether the Ascend entries are in the kernel table under ``platform``.
    """

    platform: str
    targets: Mapping[str, str]
    enabled: bool = True


_TARGETS = DEFAULT_TARGETS
# The platform name the entries are in the kernel table under; None: not installed.
_INSTALLED: str | None = None


def config() -> AscendConfig:
    """Returns the :class:`AscendConfig` in force.

    Raises:
      ValueError: if ``$CANNJAX_ASCEND_PLATFORM`` is not a lower-case identifier.
    """
    name = ascend_platform()
    return AscendConfig(name, _TARGETS, enabled=_INSTALLED == name)


# ------------------------------------------------------------------ the kernels
def _vma(x: jax.Array) -> frozenset:
    return getattr(jax.typeof(x), "vma", frozenset())


def _call(key: str, *operands: jax.Array, **attrs) -> jax.Array:
    # Under shard_map an FFI call needs operands varying over the same mesh axes, and its
    # result type must say which (the operands' type, vma included).
    vma = frozenset().union(*map(_vma, operands))
    operands = tuple(
        o if _vma(o) == vma else jax.lax.pcast(o, tuple(vma - _vma(o)), to="varying")
        for o in operands
    )
    call = jax.ffi.ffi_call(
        _TARGETS[key],
        jax.typeof(operands[0]),
        vmap_method="broadcast_all",  # elementwise: a batch is just a bigger array
    )
    return call(*operands, **attrs)


# Each kernel returns the residuals of the cannjax rule it replaces (the op's contract).
def _gelu_forward(x, *, approximate):
    return _call("gelu.forward", x, approximate=np.int64(approximate)), {"x": x}


def _gelu_backward(res, g, *, approximate):
    return (_call("gelu.backward", g, res["x"], approximate=np.int64(approximate)),)


def _silu_forward(x):
    return _call("silu.forward", x), {"x": x}


def _silu_backward(res, g):
    return (_call("silu.backward", g, res["x"]),)


def _keeps_out(op):
    def forward(x):
        y = _call(f"{op}.forward", x)
        return y, {"out": y}

    def backward(res, g):
        return (_call(f"{op}.backward", g, res["out"]),)

    return forward, backward


def _relu_forward(x):
    return _call("relu.forward", x), {"mask": x > 0}


def _softplus_forward(x):
    y = _call("softplus.forward", x, beta=np.float32(1), threshold=np.float32(20))
    return y, {"x": x}


def _entries() -> dict[str, tuple]:
    sig_f, sig_b = _keeps_out("sigmoid")
    tanh_f, tanh_b = _keeps_out("tanh")
    exp_f, exp_b = _keeps_out("exp")
    return {
        "gelu": (_gelu_forward, _gelu_backward),
        "silu": (_silu_forward, _silu_backward),
        "sigmoid": (sig_f, sig_b),
        "tanh": (tanh_f, tanh_b),
        "exp": (exp_f, exp_b),
        "relu": (_relu_forward, None),
        "softplus": (_softplus_forward, None),
    }


def install() -> None:
    """Puts the Ascend entries into the kernel table under ``config().platform``.

    Done before the first operator is traced if :func:`should_install`; call it yourself to export
    for Ascend from a machine without one. Idempotent; entries installed under an earlier
    platform name (``$CANNJAX_ASCEND_PLATFORM`` changed since) move to the current one.
    """
    global _INSTALLED
    name = ascend_platform()
    if _INSTALLED == name:
        return
    uninstall()
    for op, (forward, backward) in _entries().items():
        targets = [_TARGETS[f"{op}.{r}"] for r, f in (("forward", forward),) if f]
        targets += [_TARGETS[f"{op}.backward"]] if backward else []
        kernels.register_kernel(
            op,
            name,
            forward=forward,
            backward=backward,
            source="CANN " + " / ".join(targets),
            overwrite=True,
        )
    _INSTALLED = name


def uninstall() -> None:
    """Removes the Ascend entries from the kernel table."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    for op in _entries():
        kernels.unregister_kernel(op, _INSTALLED)
    _INSTALLED = None


def configure(
    *, platform: str | None = None, targets: Mapping[str, str] | None = None
) -> AscendConfig:
    """Changes the Ascend platform name and/or FFI target names; returns the new config.

    Call it before tracing functions that use the Ascend kernels (jit caches keep the
    table they were traced with). The platform name set here overrides
    ``$CANNJAX_ASCEND_PLATFORM`` for every per-platform default of cannjax, not only for
    this table: ``cannjax.amp.half_dtype(platform)`` is float16 and
    ``cannjax.amp.default_overflow_check(platform)`` the saturation check.

    Args:
      platform: the lowering platform name of the Ascend devices (e.g. ``"npu"`` if the
        PJRT plugin reports that).
      targets: ``"<op>.<rule>" -> target name`` overrides, merged into the current ones.

    Raises:
      ValueError: an unknown target key or a bad platform or target name.

    Example:
      >>> from cannjax import amp
      >>> from cannjax.backend import ascend
      >>> before = ascend.config().platform
      >>> ascend.configure(platform="npu").platform, amp.half_dtype("npu").name
      ('npu', 'float16')
      >>> ascend.configure(platform=before).platform
      'ascend'
    """
    global _TARGETS
    fn = "cannjax.backend.ascend.configure"
    new_targets = dict(_TARGETS)
    for key, name in (targets or {}).items():
        if key not in DEFAULT_TARGETS:
            raise ValueError(f"{fn}: unknown target key {key!r}; known: {sorted(DEFAULT_TARGETS)}")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{fn}: target name for {key!r} must be an identifier, got {name!r}")
        new_targets[key] = name
    if platform is not None:
        platform = _check_platform(fn, platform)
    was_enabled = _INSTALLED is not None
    uninstall()
    _TARGETS = TargetTable(new_targets)
    if platform is not None:
        set_ascend_platform(platform)
    if was_enabled:
        install()
    return config()


def disabled_checks() -> list:
    """``jax.export`` safety checks to disable for the configured CANN targets.

    ``jax.export`` refuses custom calls without a compatibility guarantee; the Ascend
    kernels are such calls. Pass this list as ``disabled_checks=`` to export a
    multi-platform module that includes Ascend.
    """
    names = sorted(set(_TARGETS.values()))
    return [jax.export.DisabledSafetyCheck.custom_call(n) for n in names]


def should_install(backends: Mapping | None = None) -> bool:
    """Whether the Ascend entries go into the kernel table before the first operator is traced.

    ``$CANNJAX_ASCEND_KERNELS``: ``1`` always, ``0`` never; unset (or ``auto``): when an
    initialized JAX backend has the configured Ascend platform name. Off elsewhere, since
    each operator with an entry traces its Ascend branch too, which lengthens the trace
    and lowering of those operators (docs/performance.md); the compiled non-Ascend
    program is unchanged.
    Exporting for Ascend from another machine: call :func:`install` first.

    Args:
      backends: the initialized backends by platform name (default: JAX's).

    Raises:
      ValueError: a value of the variable other than ``0``, ``1`` or ``auto``.
    """
    raw = os.environ.get(KERNELS_ENV, "").strip().lower() or "auto"
    if raw not in ("0", "1", "auto"):
        raise ValueError(f"cannjax: {KERNELS_ENV} must be 0, 1 or auto, got {raw!r}")
    if raw != "auto":
        return raw == "1"
    if backends is None:
        from jax._src import xla_bridge

        backends = xla_bridge.backends()
    return ascend_platform() in backends


def _auto_install() -> None:
    if should_install():
        install()


# Decided when the first operator is traced: asking JAX for its backends at import would
# start one (and jax.distributed.initialize must come before that).
kernels.defer_until_first_use(_auto_install)
