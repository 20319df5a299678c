"""A host-side gradient-health history that flags problems: :class:`GradMonitor`.

It keeps the :func:`~cannjax.health.grad_stats` of every ``every``-th step and flags
vanishing (``norm < vanishing``), exploding (``norm > exploding``) and non-finite leaves,
and a loss scale stuck at its minimum. It renders its latest record as a text table
(``str``) and as HTML in Jupyter (``_repr_html_``), and plots its history with
matplotlib.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from cannjax._src.core.tables import number, render, render_html
from cannjax._src.health.statistics import FIELDS, HEADERS, GradStats

_FN = "cannjax.health"


class HealthFlag(NamedTuple):
    """A problem the monitor found: at ``step``, leaf ``path`` is ``kind`` with ``value``.

    ``kind`` is ``"nonfinite"`` (value: NaN + Inf count), ``"exploding"`` or
    ``"vanishing"`` (value: the norm); ``path`` is ``"<global>"`` for the global norm.
    ``kind`` ``"loss_scale_stuck"`` (path ``"<loss_scale>"``, value: the overflows counted
    at the minimum scale) comes from a loss scale handed to :meth:`GradMonitor.update`.
    """

    step: int
    path: str
    kind: str
    value: float


class _Record(NamedTuple):
    step: int
    stats: dict  # field -> numpy array
    global_norm: float


class GradMonitor:
    """Keeps a host-side gradient-health history and flags problems.

    Compute :func:`grad_stats` inside the jitted step and hand the result to
    :meth:`update` every step: it copies the statistics to the host only when
    ``step % every == 0`` (one small transfer), appends them to :attr:`history` and
    returns the new :class:`HealthFlag` s. A leaf is flagged ``nonfinite`` if it has a
    NaN/Inf, ``exploding`` if its norm (or the global norm) exceeds ``exploding`` (an
    overflowed, infinite norm included), ``vanishing`` if its norm is below ``vanishing``.

    Args:
      every: record every ``every`` steps (``>= 1``).
      vanishing: norm threshold below which a leaf is vanishing (``>= 0``).
      exploding: norm threshold above which a leaf is exploding (``> vanishing``).
      max_history: keep at most this many records (oldest dropped); None keeps all.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.health import GradMonitor, grad_stats
      >>> mon = GradMonitor(every=2, vanishing=1e-6, exploding=1e3)
      >>> for step in range(4):
      ...     flags = mon.update(step, grad_stats({"w": jnp.full(4, 10.0 ** (2 * step))}))
      >>> [r.step for r in mon.history]
      [0, 2]
      >>> [(f.step, f.path, f.kind) for f in mon.flags]
      [(2, "['w']", 'exploding'), (2, '<global>', 'exploding')]
    """

    def __init__(
        self,
        every: int = 10,
        *,
        vanishing: float = 1e-7,
        exploding: float = 1e3,
        max_history: int | None = None,
    ):
        fn = f"{_FN}.GradMonitor"
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"{fn}: every must be an int >= 1, got {every!r}")
        if not (isinstance(vanishing, (int, float)) and vanishing >= 0):
            raise ValueError(f"{fn}: vanishing must be a number >= 0, got {vanishing!r}")
        if not (isinstance(exploding, (int, float)) and exploding > vanishing):
            raise ValueError(
                f"{fn}: exploding must be a number > vanishing ({vanishing}), got {exploding!r}"
            )
        if max_history is not None and (not isinstance(max_history, int) or max_history < 1):
            raise ValueError(f"{fn}: max_history must be None or an int >= 1, got {max_history!r}")
        self.every = every
        self.vanishing = float(vanishing)
        self.exploding = float(exploding)
        self.max_history = max_history
        self.history: list[_Record] = []
        self.flags: list[HealthFlag] = []
        self.paths: tuple[str, ...] = ()

    def should_record(self, step: int) -> bool:
        """Whether :meth:`update` at ``step`` records (``step % every == 0``)."""
        return step % self.every == 0

    def update(self, step: int, stats: GradStats, loss_scale: Any = None) -> list[HealthFlag]:
        """Records ``stats`` at ``step`` if due; returns the flags raised by this record.

        ``loss_scale``: optionally the step's :mod:`cannjax.amp` loss scale. A dynamic
        scale stuck at its minimum (gradients overflow even there) is then flagged
        ``loss_scale_stuck`` here, with the other flags, instead of warned about by
        :func:`cannjax.amp.check_loss_scale`.
        """
        if not isinstance(stats, GradStats):
            raise TypeError(
                f"{_FN}.GradMonitor.update: stats must be a GradStats from "
                f"cannjax.health.grad_stats, got {type(stats).__name__}"
            )
        if not self.should_record(int(step)):
            return []
        if self.paths and stats.paths != self.paths:
            raise ValueError(
                f"{_FN}.GradMonitor.update: the gradient pytree changed: the history has "
                f"leaves {list(self.paths)}, got {list(stats.paths)}; use one monitor per model"
            )
        self.paths = stats.paths
        host = jax.device_get({k: getattr(stats, k) for k in (*FIELDS, "global_norm")})
        gnorm = float(host.pop("global_norm"))
        self.history.append(_Record(int(step), host, gnorm))
        if self.max_history is not None and len(self.history) > self.max_history:
            del self.history[0]
        new = self._flags(int(step), host, gnorm)
        if loss_scale is not None:
            new += _loss_scale_flags(int(step), loss_scale)
        self.flags.extend(new)
        return new

    def _flags(self, step: int, host: dict, gnorm: float) -> list[HealthFlag]:
        out = []
        for i, path in enumerate(self.paths):
            bad = int(host["nan_count"][i]) + int(host["inf_count"][i])
            norm = float(host["norm"][i])
            if bad:
                out.append(HealthFlag(step, path, "nonfinite", float(bad)))
            elif norm > self.exploding:
                out.append(HealthFlag(step, path, "exploding", norm))
            elif norm < self.vanishing:
                out.append(HealthFlag(step, path, "vanishing", norm))
        # An overflowed (infinite) global norm from finite leaves is an explosion too.
        if gnorm > self.exploding and not any(f.kind == "nonfinite" for f in out):
            out.append(HealthFlag(step, "<global>", "exploding", gnorm))
        return out

    # ------------------------------------------------------------ rendering
    def _latest(self) -> tuple[_Record, list[list[str]]]:
        """The latest record and its table rows: leaf, statistics, flags of that step."""
        rec = self.history[-1]
        rows = [
            [p, *(number(rec.stats[k][i].item()) for k in FIELDS), self._flag_of(rec.step, p)]
            for i, p in enumerate(self.paths)
        ]
        return rec, rows

    def _flag_of(self, step: int, path: str) -> str:
        return ",".join(f.kind for f in self.flags if f.step == step and f.path == path)

    def table(self) -> str:
        """The latest record as a text table, then the flags of that step."""
        if not self.history:
            return "GradMonitor: no record yet"
        rec, rows = self._latest()
        head = (
            f"step {rec.step}: global norm {number(rec.global_norm)} "
            f"({len(self.history)} records, every {self.every} steps, "
            f"{len(self.flags)} flags)"
        )
        return head + "\n" + render(["leaf", *HEADERS, "flag"], rows, grid=True)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (
            f"GradMonitor(every={self.every}, vanishing={self.vanishing:g}, "
            f"exploding={self.exploding:g}: {len(self.history)} records, "
            f"{len(self.flags)} flags)"
        )

    def _repr_html_(self) -> str:
        if not self.history:
            return "<p>GradMonitor: no record yet</p>"
        rec, rows = self._latest()
        bad = {i for i, r in enumerate(rows) if r[-1]}
        caption = f"step {rec.step}: global norm {number(rec.global_norm)}"
        return render_html(["leaf", *HEADERS, "flag"], rows, caption, marked=bad)

    def plot(self, ax: Any = None, *, leaves: bool = True) -> Any:
        """Plots the global norm (and each leaf's norm) against the step, log scale.

        Thresholds are drawn as dashed lines; flagged steps are marked. Returns the axes.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 4))
        steps = [r.step for r in self.history]
        if leaves:
            for i, p in enumerate(self.paths):
                ax.plot(steps, [r.stats["norm"][i] for r in self.history], lw=0.8, label=p)
        ax.plot(steps, [r.global_norm for r in self.history], "k", lw=2, label="global")
        for y, name in ((self.vanishing, "vanishing"), (self.exploding, "exploding")):
            if y > 0:
                ax.axhline(y, ls="--", c="gray", lw=0.8)
                ax.annotate(name, (steps[0] if steps else 0, y), fontsize=8, color="gray")
        flagged = sorted({f.step for f in self.flags})
        gn = {r.step: r.global_norm for r in self.history}
        ax.plot(flagged, [gn.get(s, np.nan) for s in flagged], "rx", label="flagged")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("gradient L2 norm")
        ax.legend(fontsize=7)
        return ax


def _loss_scale_flags(step: int, loss_scale: Any) -> list[HealthFlag]:
    # Imported here: cannjax.amp imports nothing from health, and health should not
    # pull amp in for users who never scale a loss.
    from cannjax._src.amp.loss_scale import LossScaleWarning, check_loss_scale

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossScaleWarning)
        try:
            report = check_loss_scale(loss_scale)
        except TypeError as e:
            raise TypeError(
                f"{_FN}.GradMonitor.update: loss_scale must be a cannjax.amp loss scale, "
                f"got {type(loss_scale).__name__}"
            ) from e
    if not report["stuck"]:
        return []
    return [HealthFlag(step, "<loss_scale>", "loss_scale_stuck", report["min_scale_overflows"])]
