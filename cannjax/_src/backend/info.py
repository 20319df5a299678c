"""What cannjax runs on: platform, devices, PJRT plugins and the active kernel tables.

Example:
  >>> import cannjax
  >>> report = cannjax.backend.info()
  >>> report.default_platform
  'cpu'
  >>> "kernel tables" in str(report)
  True
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import pkgutil
from collections.abc import Mapping

import jax

import cannjax_ascend_plugin
from cannjax._src.backend import ascend
from cannjax._src.core.kernels import kernel_table
from cannjax._src.core.platform import PlatformFacts, facts
from cannjax._src.core.tables import render, render_html


@dataclasses.dataclass(frozen=True)
class PluginEntry:
    """An installed JAX plugin module.

    Attributes:
      name: the entry point's name (or the module name for namespace plugins).
      module: the module JAX imports and whose ``initialize()`` it calls.
      distribution: the installed distribution declaring it, if known.
      source: ``"entry point"`` (group ``jax_plugins``) or ``"jax_plugins namespace"``.
    """

    name: str
    module: str
    distribution: str | None
    source: str


def installed_plugins() -> tuple[PluginEntry, ...]:
    """The JAX plugin modules JAX would discover, as JAX itself looks for them."""
    found: list[PluginEntry] = []
    for ep in importlib.metadata.entry_points(group="jax_plugins"):
        dist = getattr(getattr(ep, "dist", None), "name", None)
        found.append(PluginEntry(ep.name, ep.value, dist, "entry point"))
    try:
        import jax_plugins  # the namespace package some plugins install into

        for mod in pkgutil.iter_modules(jax_plugins.__path__, "jax_plugins."):
            found.append(
                PluginEntry(mod.name.split(".", 1)[1], mod.name, None, "jax_plugins namespace")
            )
    except ImportError:
        pass
    return tuple(sorted(set(found), key=lambda p: (p.module, p.name)))


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """A report on the JAX backends and cannjax's per-platform settings.

    ``str(report)`` renders it as text; in a notebook it renders as HTML.

    Attributes:
      jax_version: the running JAX version.
      default_platform: ``jax.default_backend()``.
      devices: ``"platform:id kind"`` for each device of the default backend.
      backends: the initialized backends, by platform name.
      plugins: the installed JAX plugin modules (:func:`installed_plugins`).
      kernels: operator -> platform -> the rules replaced there (``("forward",
        "backward")``) and the kernel's source.
      ascend: the Ascend settings: platform name, plugin library variable and status,
        half dtype, overflow mode, matmul multiple.
      defaults: the default platform's per-platform settings (what ``cannjax.amp`` and
        the matmul padding use here): whether it is Ascend, half dtype, overflow mode,
        matmul multiple.
    """

    jax_version: str
    default_platform: str
    devices: tuple[str, ...]
    backends: tuple[str, ...]
    plugins: tuple[PluginEntry, ...]
    kernels: Mapping[str, Mapping[str, tuple[tuple[str, ...], str]]]
    ascend: Mapping[str, str]
    defaults: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def _sections(self) -> list[tuple[str, tuple[str, str], list[tuple[str, str]]]]:
        """(title, column headers, rows) of each part of the report."""
        plugins = [
            (p.name, f"{p.module} ({p.source}{', ' + p.distribution if p.distribution else ''})")
            for p in self.plugins
        ] or [("(none)", "no jax_plugins entry points or namespace modules installed")]
        kern = [
            (f"{op} @ {platform}", f"{'+'.join(rules)}: {source}")
            for op, per in self.kernels.items()
            for platform, (rules, source) in per.items()
        ] or [("(none)", "every operator uses its XLA rules")]
        return [
            (
                "platform",
                ("setting", "value"),
                [
                    ("jax", self.jax_version),
                    ("default platform", self.default_platform),
                    ("devices", ", ".join(self.devices)),
                    ("initialized backends", ", ".join(self.backends)),
                    *self.defaults.items(),
                ],
            ),
            ("PJRT plugins", ("plugin", "module (found as, distribution)"), plugins),
            ("kernel tables (others: XLA rules)", ("op @ platform", "rules: kernel"), kern),
            ("ascend", ("setting", "value"), list(self.ascend.items())),
        ]

    def __str__(self) -> str:
        lines = ["cannjax backend"]
        for title, headers, rows in self._sections():
            lines += ["", f"{title}:"]
            lines += ["  " + ln for ln in render(headers, rows).splitlines()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        """The table ``print`` shows: a REPL shows the report, not its fields."""
        return str(self)

    def _repr_html_(self) -> str:
        tables = [render_html(h, rows, title) for title, h, rows in self._sections()]
        return "<div><p><b>cannjax backend</b></p>" + "".join(tables) + "</div>"


def info() -> BackendInfo:
    """Reports the platform, devices, PJRT plugins and active kernel tables.

    Initializes JAX's backends (as ``jax.devices()`` does).

    Returns:
      A :class:`BackendInfo`; print it, or display it in a notebook.
    """
    from jax._src import xla_bridge

    devices = tuple(f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices())
    backends = tuple(sorted(xla_bridge.backends()))
    table = {
        op: {p: (k.rules(), k.source) for p, k in per.items()} for op, per in kernel_table().items()
    }
    cfg = ascend.config()
    st = cannjax_ascend_plugin.status()
    asc = {
        "platform name": cfg.platform,
        "kernel entries": "installed" if cfg.enabled else "not installed",
        "plugin library": f"${cannjax_ascend_plugin.LIBRARY_ENV}="
        + (cannjax_ascend_plugin.library_path() or "(unset)"),
        "plugin status": f"{st.state}: {st.message}",
        "available": "yes" if cfg.platform in backends else "no",
        **_fact_rows(facts(cfg.platform)),
    }
    here = facts()
    defaults = {"is ascend": "yes" if here.is_ascend else "no", **_fact_rows(here)}
    return BackendInfo(
        jax_version=jax.__version__,
        default_platform=jax.default_backend(),
        devices=devices,
        backends=backends,
        plugins=installed_plugins(),
        kernels=table,
        ascend=asc,
        defaults=defaults,
    )


def _fact_rows(f: PlatformFacts) -> dict[str, str]:
    return {
        "half dtype": f.half_dtype.name,
        "overflow mode": f.overflow_mode,
        "matmul multiple": str(f.matmul_multiple),
    }
