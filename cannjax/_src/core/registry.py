"""The operator registry: name -> :class:`OpSpec`, read-only to users."""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class Level(enum.IntEnum):
    """What an operator's forward keeps for its backward (CANN's gradient optimization level).

    Higher levels keep more computed state and recompute less in the backward.

    * ``RECOMPUTE`` (0): keeps only inputs; the backward recomputes what it needs
      (``sin`` keeps ``x`` and evaluates ``cos(x)`` in the backward).
    * ``OUTPUT`` (1): keeps the forward's output, which exists anyway
      (``exp``: ``d exp(x) = exp(x) dx``).
    * ``DERIVED`` (2): keeps a compact value computed in the forward for the backward:
      a boolean mask (``relu``), per-row statistics (``layer_norm``), or a local
      derivative that is cheaper to keep than to recompute.
    """

    RECOMPUTE = 0
    OUTPUT = 1
    DERIVED = 2


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Everything cannjax knows about one operator.

    Attributes:
      name: registry key, e.g. ``"gelu"``.
      fn: the public function (validates input, then binds the operator).
      reference: the same math in plain ``jax.numpy`` (differentiated by plain JAX).
      sample: ``sample(key) -> tuple`` of valid positional arguments for ``fn``.
      edges: ``edges() -> list[EdgeCase]`` of edge points (zeros, infinities, huge or tiny
        magnitudes) with the checks that apply there.
      configs: keyword-argument sets that ``fn`` supports (``[{}]`` when none), each
        checked by the test suite.
      residuals: residual name -> what it holds, e.g. ``{"out": "exp(x), same shape as x"}``.
        Saved under ``cannjax.<name>.<key>`` for remat policies.
      reuse: indices of inputs that the op may overwrite or donate: the backward does not
        read them (CANN's ``can_reuse_memory``).
      level: see :class:`Level`.
      nondiff_argnums: positional arguments that get no gradient (labels, masks).
      doc: one-line summary; by default the first line of ``fn.__doc__``.
    """

    name: str
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    sample: Callable[[Any], tuple]
    residuals: Mapping[str, str]
    reuse: tuple[int, ...] = ()
    level: Level = Level.RECOMPUTE
    nondiff_argnums: tuple[int, ...] = ()
    configs: Sequence[Mapping[str, Any]] = ({},)
    edges: Callable[[], list] = list
    doc: str | None = None

    def __post_init__(self) -> None:
        # The summary is usually the docstring's first line; say it once, in the docstring.
        if self.doc is None:
            lines = (getattr(self.fn, "__doc__", None) or "").strip().splitlines()
            object.__setattr__(self, "doc", lines[0].strip() if lines else "")


@dataclasses.dataclass(frozen=True)
class EdgeCase:
    """An edge point of an operator and what is checked there.

    Attributes:
      args: positional arguments.
      kwargs: keyword arguments.
      finite_differences: whether central differences are meaningful here (not at a kink
        or where an input is infinite).
      reference_value: whether the reference gives the right value here (``jax.nn.gelu``
        gives NaN at ``-inf``, where the limit is 0).
      reference_grad: whether plain autodiff of the reference is expected to give the right
        gradient here (it gives NaN at several of the points cannjax fixes).
      expected_value: the exact value, when known and the reference is not usable.
      expected_grad: the exact gradient to compare against, when known and the reference
        is not usable (a tuple matching the differentiable arguments).
      second_order: whether second derivatives are checked here (not where they overflow
        the dtype, so that ``inf - inf`` is unavoidable).
      rtol: relative tolerance, where this point is ill-conditioned (None: the dtype's).
      atol: absolute tolerance, likewise.
    """

    args: tuple
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    finite_differences: bool = True
    reference_value: bool = True
    reference_grad: bool = True
    expected_value: Any = None
    expected_grad: tuple | None = None
    second_order: bool = True
    rtol: float | None = None
    atol: float | None = None

    def check_kwargs(self, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The keyword arguments of :func:`cannjax.testing.check_op` for this case, run
        under ``config`` (one of the spec's ``configs``): the case's own ``kwargs`` win,
        since an edge point is written for them (``{"axis": -1}`` for a last-axis case)."""
        return dict(
            finite_differences=self.finite_differences,
            reference_value=self.reference_value,
            reference_grad=self.reference_grad,
            expected_value=self.expected_value,
            expected_grad=self.expected_grad,
            second_order=self.second_order,
            rtol=self.rtol,
            atol=self.atol,
            **{**(config or {}), **self.kwargs},
        )


def written_for(
    config: Mapping[str, Any], edges: Callable[[], list[EdgeCase]]
) -> Callable[[], list[EdgeCase]]:
    """Edge cases written for ``config`` (``{"axis": -1}``, say): each case states it,
    unless it names those keyword arguments itself, so that running the cases under the
    spec's other configs (:meth:`EdgeCase.check_kwargs`) keeps their meaning."""

    def cases() -> list[EdgeCase]:
        return [dataclasses.replace(c, kwargs={**config, **c.kwargs}) for c in edges()]

    return cases


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec, *, overwrite: bool = False) -> OpSpec:
    """Adds ``spec`` to the registry; user-defined operators may be registered too.

    Raises:
      ValueError: if an operator of that name exists and ``overwrite`` is False.
    """
    if not isinstance(spec, OpSpec):
        raise TypeError(f"cannjax.register: spec must be an OpSpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY and not overwrite:
        raise ValueError(
            f"cannjax.register: an operator named {spec.name!r} is already registered; "
            "pass overwrite=True to replace it"
        )
    _REGISTRY[spec.name] = spec
    return spec


def registry() -> Mapping[str, OpSpec]:
    """Returns a read-only mapping from operator name to :class:`OpSpec`."""
    return types.MappingProxyType(_REGISTRY)


def lookup(op: str | Callable[..., Any] | OpSpec) -> OpSpec:
    """Finds the spec of ``op``, given as a name, a public function or a spec.

    Raises:
      KeyError: if ``op`` is not registered.
    """
    if isinstance(op, OpSpec):
        return op
    if isinstance(op, str):
        if op not in _REGISTRY:
            raise KeyError(f"cannjax: no operator named {op!r}; known: {sorted(_REGISTRY)}")
        return _REGISTRY[op]
    for spec in _REGISTRY.values():
        if spec.fn is op:
            return spec
    raise KeyError(f"cannjax: {op!r} is not a registered operator")
