"""The ``jax_plugins`` entry point that registers an Ascend PJRT plugin for cannjax.

JAX imports this module while it discovers its backends and calls :func:`initialize`.
It is a top-level package on purpose: it imports nothing from ``cannjax`` (whose import
creates arrays, which would re-enter JAX's backend discovery) and nothing heavy.

Configuration (environment variables, read when JAX discovers its backends):

* ``CANNJAX_ASCEND_PJRT_LIBRARY``: path of the Ascend PJRT plugin shared library
  (``libpjrt_ascend.so`` or similar). Unset or empty: this plugin does nothing.
* ``CANNJAX_ASCEND_PLATFORM``: the platform name the plugin is registered under and that
  cannjax's Ascend kernel table uses (default ``"ascend"``). It must equal the platform
  name the plugin's devices report (``jax.devices()[0].platform``).
* ``CANNJAX_ASCEND_PRIORITY``: backend priority (default 400, as for JAX's own plugins).
"""

from cannjax_ascend_plugin._plugin import DEFAULT_PLATFORM as DEFAULT_PLATFORM
from cannjax_ascend_plugin._plugin import LIBRARY_ENV as LIBRARY_ENV
from cannjax_ascend_plugin._plugin import PLATFORM_ENV as PLATFORM_ENV
from cannjax_ascend_plugin._plugin import PRIORITY_ENV as PRIORITY_ENV
from cannjax_ascend_plugin._plugin import PluginStatus as PluginStatus
from cannjax_ascend_plugin._plugin import initialize as initialize
from cannjax_ascend_plugin._plugin import library_path as library_path
from cannjax_ascend_plugin._plugin import platform_name as platform_name
from cannjax_ascend_plugin._plugin import status as status

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
