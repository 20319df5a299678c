"""A notebook-ready plot of the loss scale and the skipped steps over a training run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def plot_loss_scale(
    loss_scales: Sequence[float] | np.ndarray,
    grads_finite: Sequence[bool] | np.ndarray,
    *,
    ax: Any = None,
    title: str | None = "dynamic loss scale",
) -> Any:
    """Plots the loss scale (log2 axis) and marks skipped steps, for one run.

    Collect per step ``float(result.loss_scale.loss_scale)`` (the scale *used* for the
    step, i.e. before its adjust) and ``bool(result.grads_finite)``, or stack them from
    a ``lax.scan``. Skipped steps are drawn as red ticks under the curve; the right
    axis shows the cumulative count of skipped steps. Needs matplotlib (the
    ``notebooks`` extra), imported only when called.

    Args:
      loss_scales: the scale at each step, shape ``(steps,)``.
      grads_finite: whether each step was applied, shape ``(steps,)``.
      ax: a matplotlib Axes to draw on; ``None`` makes a new 6x3 inch figure.
      title: the axes title (``None`` for none).

    Returns:
      The matplotlib Axes (``ax.figure`` is the figure to ``savefig``).

    Raises:
      ValueError: if the two sequences are empty or differ in length, or a scale is
        not positive.

    Example:
      >>> import matplotlib
      >>> matplotlib.use("Agg")
      >>> from cannjax import amp
      >>> ax = amp.plot_loss_scale([4.0, 2.0, 2.0, 4.0], [False, True, True, True])
      >>> ax.get_ylabel()
      'loss scale'
    """
    fn = "cannjax.amp.plot_loss_scale"
    scales = np.asarray(loss_scales, dtype=np.float64).reshape(-1)
    finite = np.asarray(grads_finite, dtype=bool).reshape(-1)
    if scales.size == 0 or scales.shape != finite.shape:
        raise ValueError(
            f"{fn}: loss_scales and grads_finite must be non-empty and of equal length, "
            f"got {scales.shape[0]} and {finite.shape[0]}"
        )
    if not np.all(scales > 0):
        raise ValueError(f"{fn}: loss_scales must be > 0, got min {scales.min()}")
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3), dpi=100)
    steps = np.arange(scales.size)
    ax.step(steps, scales, where="post", color="C0", lw=1.5, label="loss scale")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    skipped = ~finite
    if skipped.any():
        ax.plot(
            steps[skipped],
            scales[skipped],
            "v",
            color="C3",
            ms=4,
            label=f"skipped ({int(skipped.sum())})",
        )
    right = ax.twinx()
    right.plot(steps, np.cumsum(skipped), color="C3", lw=1, alpha=0.5)
    right.set_ylabel("skipped steps (cumulative)", color="C3")
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title)
    ax.figure.tight_layout()
    return ax
