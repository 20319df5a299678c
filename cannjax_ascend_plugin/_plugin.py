"""Registration of the Ascend PJRT plugin from environment variables (see the package)."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings

__all__ = [
    "DEFAULT_PLATFORM",
    "LIBRARY_ENV",
    "PLATFORM_ENV",
    "PRIORITY_ENV",
    "PluginStatus",
    "initialize",
    "library_path",
    "platform_name",
    "status",
]

LIBRARY_ENV = "CANNJAX_ASCEND_PJRT_LIBRARY"
PLATFORM_ENV = "CANNJAX_ASCEND_PLATFORM"
PRIORITY_ENV = "CANNJAX_ASCEND_PRIORITY"
DEFAULT_PLATFORM = "ascend"
_DEFAULT_PRIORITY = 400

logger = logging.getLogger("cannjax.backend")


@dataclasses.dataclass(frozen=True)
class PluginStatus:
    """What the last :func:`initialize` call did.

    Attributes:
      state: ``"not initialized"``, ``"not configured"`` (no library path set),
        ``"registered"`` or ``"failed"``.
      platform: the platform name used for registration.
      library_path: the configured library path, or None.
      message: a human-readable explanation (the error, when ``state == "failed"``).
    """

    state: str
    platform: str
    library_path: str | None
    message: str


_STATUS = PluginStatus("not initialized", DEFAULT_PLATFORM, None, "initialize() was not called")


def platform_name() -> str:
    """The Ascend platform name: ``$CANNJAX_ASCEND_PLATFORM`` or ``"ascend"``.

    Raises:
      ValueError: if the variable is set to something that is not a lower-case identifier.
    """
    name = os.environ.get(PLATFORM_ENV, "").strip() or DEFAULT_PLATFORM
    if not name.isidentifier() or name != name.lower():
        raise ValueError(
            f"cannjax: {PLATFORM_ENV} must be a lower-case platform name such as 'ascend' "
            f"or 'npu', got {name!r}"
        )
    return name


def library_path() -> str | None:
    """The configured plugin library path (``$CANNJAX_ASCEND_PJRT_LIBRARY``), or None."""
    path = os.environ.get(LIBRARY_ENV, "").strip()
    return path or None


def _priority() -> int:
    raw = os.environ.get(PRIORITY_ENV, "").strip()
    if not raw:
        return _DEFAULT_PRIORITY
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"cannjax: {PRIORITY_ENV} must be an integer, got {raw!r}") from None


def status() -> PluginStatus:
    """Returns the :class:`PluginStatus` of the last :func:`initialize` call."""
    return _STATUS


def _fail(platform: str, path: str | None, message: str) -> PluginStatus:
    global _STATUS
    _STATUS = PluginStatus("failed", platform, path, message)
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return _STATUS


def initialize() -> PluginStatus:
    """Registers the Ascend PJRT plugin if ``$CANNJAX_ASCEND_PJRT_LIBRARY`` is set.

    Called by JAX's plugin discovery (entry point group ``jax_plugins``). Without the
    variable it does nothing. A missing file, a bad setting or a library that fails to
    load gives a ``RuntimeWarning`` and a ``"failed"`` status, never an exception: JAX
    keeps working with its other backends.

    Returns:
      The new :class:`PluginStatus`.
    """
    global _STATUS
    path = library_path()
    try:
        platform = platform_name()
        priority = _priority()
    except ValueError as e:
        return _fail(DEFAULT_PLATFORM, path, str(e))
    if path is None:
        _STATUS = PluginStatus(
            "not configured", platform, None, f"{LIBRARY_ENV} is not set; nothing registered"
        )
        return _STATUS
    if not os.path.isfile(path):
        return _fail(
            platform,
            path,
            f"cannjax: {LIBRARY_ENV}={path!r} does not name a file; the Ascend PJRT plugin "
            f"is not registered. Point it at the plugin's shared library or unset it.",
        )
    try:
        from jax._src import xla_bridge

        xla_bridge.register_plugin(platform, priority=priority, library_path=path)
    except Exception as e:  # noqa: BLE001 -- a broken plugin must not break JAX
        return _fail(
            platform,
            path,
            f"cannjax: loading the Ascend PJRT plugin {path!r} as platform {platform!r} "
            f"failed: {type(e).__name__}: {e}",
        )
    _STATUS = PluginStatus(
        "registered", platform, path, f"registered {path!r} as platform {platform!r}"
    )
    logger.info(_STATUS.message)
    return _STATUS
