"""Rematerialization: checkpointed scans, named-residual policies and a budget planner.

* :func:`checkpointed_scan`: ``lax.scan`` whose backward keeps a bounded number of carries
  (``"none"``, ``"every"``, ``"sqrt"``, ``"binomial"``).
* :func:`checkpoint`: ``jax.checkpoint`` with a policy from :mod:`policies`, which target
  cannjax's residual names ``cannjax.<op>.<key>``.
* :func:`plan`: given a chain (a scanned body or a list of layers) and a memory budget in
  bytes, picks what to keep and what to recompute at the least recomputation; the plan
  reports its predicted and compiled memory and applies itself.

Note that XLA:CPU undoes ``jax.checkpoint`` around unrolled Python-loop code (it drops the
barriers and CSE removes the recomputation): use :func:`checkpoint` inside a scanned body,
or use :func:`checkpointed_scan` / :func:`plan`, whose remat survives compilation.

Example:
  >>> import jax, jax.numpy as jnp, cannjax
  >>> body = lambda h, w: (jnp.tanh(h @ w), None)
  >>> ws = jnp.full((8, 4, 4), 0.1)
  >>> h, _ = cannjax.remat.checkpointed_scan(body, jnp.ones(4), ws, checkpoints=2)
  >>> h.shape
  (4,)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from cannjax._src.core.decorators import keyword_decorator
from cannjax._src.remat import policies as policies
from cannjax._src.remat import revolve as revolve
from cannjax._src.remat.planner import Plan as Plan
from cannjax._src.remat.planner import plan as plan
from cannjax._src.remat.scan import SCHEDULES as SCHEDULES
from cannjax._src.remat.scan import checkpointed_scan as checkpointed_scan


@keyword_decorator
def checkpoint(
    fun: Callable[..., Any],
    *,
    policy: Callable[..., bool] | None = None,
    prevent_cse: bool = True,
    static_argnums: int | Sequence[int] = (),
) -> Callable[..., Any]:
    """``jax.checkpoint(fun)`` with a policy over cannjax's named residuals.

    The backward of the returned function keeps what ``policy`` saves and recomputes the
    rest from ``fun``'s inputs. ``policy=None`` keeps nothing but the inputs. Policies live
    in :mod:`cannjax.remat.policies`: ``save_ops("layer_norm")``, ``save_statistics``,
    ``save_dots``, ``save_all_but_elementwise``, ``save_names("cannjax.*.mask")``, ...
    Also a decorator: ``@cannjax.remat.checkpoint(policy=...)``.

    Args:
      fun: the function to rematerialize.
      policy: ``policy(prim, *avals, **params) -> bool``, or None.
      prevent_cse: as for ``jax.checkpoint``; False is safe (and faster) inside scans.
      static_argnums: as for ``jax.checkpoint``.

    Returns:
      The wrapped function, with ``fun``'s name and docstring.

    Raises:
      TypeError: ``fun`` or ``policy`` not callable.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> f = lambda x: cannjax.ops.exp(cannjax.ops.tanh(x)).sum()
      >>> g = cannjax.remat.checkpoint(f, policy=cannjax.remat.policies.nothing_saveable)
      >>> bool(jnp.allclose(jax.grad(g)(jnp.ones(3)), jax.grad(f)(jnp.ones(3))))
      True
      >>> cannjax.inspect.residuals(g, jnp.ones(3)).count      # only the input
      1
    """
    if not callable(fun):
        raise TypeError(f"cannjax.remat.checkpoint: fun must be callable, got {fun!r}")
    if policy is not None and not callable(policy):
        raise TypeError(
            f"cannjax.remat.checkpoint: policy must be callable or None, got {policy!r}; "
            "pick one from cannjax.remat.policies"
        )
    wrapped = jax.checkpoint(
        fun, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums
    )
    return functools.wraps(fun)(wrapped)
