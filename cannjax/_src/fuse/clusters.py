"""Finding the maximal clusters of elementwise equations in a jaxpr.

A cluster is a set of elementwise equations (see :func:`kind_of`) connected by data
flow that can run as one operator: it must be *convex*, i.e. no path leaves the cluster
through another equation and comes back into it (else that equation would need the
cluster's output before the cluster could run). The search is greedy in program order:
each elementwise equation joins the clusters of its elementwise producers when that keeps
every cluster convex, and starts a new cluster otherwise.

Convexity is checked with dependency sets: ``deps[v]`` is the set of clusters that the
value ``v`` depends on (through anything). An equation ``e`` may join cluster ``C`` only
if none of ``e``'s other inputs depends on ``C``; two clusters may merge only if neither
depends on the other through outside work.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from jax._src import core as jcore

from cannjax._src.core.graph import producers
from cannjax._src.core.jaxpr import kind_of


@dataclasses.dataclass
class Cluster:
    """Equations (indices into the jaxpr, in program order) that fuse as one operator.

    Attributes:
      eqns: equation indices, ascending.
      inputs: vars read by the cluster and defined outside it, in first-use order.
      outputs: vars defined in the cluster and read outside it (or returned).
    """

    eqns: list[int]
    inputs: list[jcore.Var] = dataclasses.field(default_factory=list)
    outputs: list[jcore.Var] = dataclasses.field(default_factory=list)


class _UnionFind:
    def __init__(self):
        self.parent: list[int] = []

    def new(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        self.parent[b] = a
        return a


def find_clusters(jaxpr: jcore.Jaxpr) -> list[Cluster]:
    """The maximal convex clusters of elementwise equations of ``jaxpr``.

    Every elementwise equation is in exactly one cluster (possibly of size one); the
    caller decides which clusters are worth fusing.
    """
    uf = _UnionFind()
    eqn_cluster: dict[int, int] = {}  # equation index -> raw cluster id
    made = producers(jaxpr)  # var -> (equation index, output position)
    deps: dict[jcore.Var, frozenset[int]] = {}  # var -> raw cluster ids it depends on
    indeps: dict[int, set[int]] = {}  # root cluster id -> raw ids its inputs depend on

    def resolve(ids) -> set[int]:
        return {uf.find(i) for i in ids}

    def cluster_of(v) -> int | None:
        i = made[v][0] if v in made else None
        return None if i is None or i not in eqn_cluster else uf.find(eqn_cluster[i])

    for i, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if isinstance(v, jcore.Var)]
        in_deps = frozenset().union(*(deps.get(v, frozenset()) for v in ins))
        kind, _ = kind_of(eqn)
        if kind == "kept":
            for v in eqn.outvars:
                deps[v] = in_deps
            continue
        chosen: list[int] = []
        for c in sorted({c for v in ins if (c := cluster_of(v)) is not None}):
            trial = [*chosen, c]
            if _legal(trial, ins, cluster_of, deps, indeps, resolve):
                chosen = trial
        if chosen:
            root = chosen[0]
            merged_in = set(indeps.pop(root))
            for c in chosen[1:]:
                merged_in |= indeps.pop(c)
                root = uf.union(root, c)
        else:
            root = uf.new()
            merged_in = set()
        eqn_cluster[i] = root
        for v in ins:
            if cluster_of(v) != root:
                merged_in |= deps.get(v, frozenset())
        indeps[root] = merged_in
        for v in eqn.outvars:
            deps[v] = in_deps | {root}

    groups: dict[int, list[int]] = {}
    for i in sorted(eqn_cluster):
        groups.setdefault(uf.find(eqn_cluster[i]), []).append(i)
    clusters = [Cluster(eqns) for eqns in groups.values()]
    _fill_interfaces(jaxpr, clusters)
    return clusters


def _legal(trial, ins, cluster_of, deps, indeps, resolve) -> bool:
    s = set(trial)
    for v in ins:
        c = cluster_of(v)
        if c in s:
            if resolve(indeps[c]) & s:
                return False
        elif resolve(deps.get(v, frozenset())) & s:
            return False
    return True


def _fill_interfaces(jaxpr: jcore.Jaxpr, clusters: Sequence[Cluster]) -> None:
    owner: dict[int, int] = {i: k for k, c in enumerate(clusters) for i in c.eqns}
    defined_in = {v: owner[i] for v, (i, _) in producers(jaxpr).items() if i in owner}
    used_outside: dict[int, list[jcore.Var]] = {k: [] for k in range(len(clusters))}

    def mark(v, user):
        k = defined_in.get(v)
        if k is not None and k != user and v not in used_outside[k]:
            used_outside[k].append(v)

    for i, eqn in enumerate(jaxpr.eqns):
        k = owner.get(i)
        for v in eqn.invars:
            if not isinstance(v, jcore.Var):
                continue
            mark(v, k)
            if k is not None and defined_in.get(v) != k and v not in clusters[k].inputs:
                clusters[k].inputs.append(v)
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Var):
            mark(v, None)
    for k, c in enumerate(clusters):
        c.outputs = used_outside[k]


def schedule(jaxpr: jcore.Jaxpr, nodes: Sequence[Sequence[int]]) -> list[int]:
    """A topological order of ``nodes`` (each a list of equation indices run together).

    Among ready nodes the one whose first equation comes first in the program runs first,
    so unfused programs keep their order.
    """
    node_of = {i: k for k, eqns in enumerate(nodes) for i in eqns}
    producer = {v: node_of[i] for v, (i, _) in producers(jaxpr).items()}
    preds: list[set[int]] = [set() for _ in nodes]
    for k, eqns in enumerate(nodes):
        for i in eqns:
            for v in jaxpr.eqns[i].invars:
                p = producer.get(v) if isinstance(v, jcore.Var) else None
                if p is not None and p != k:
                    preds[k].add(p)
    succs: list[list[int]] = [[] for _ in nodes]
    for k, ps in enumerate(preds):
        for p in ps:
            succs[p].append(k)
    waiting = [len(ps) for ps in preds]
    ready = [(nodes[k][0], k) for k in range(len(nodes)) if not waiting[k]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(k)
        for s in succs[k]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(ready, (nodes[s][0], s))
    if len(order) != len(nodes):  # a cycle: the clusters were not convex
        raise AssertionError("cannjax.fuse: internal error: fused clusters form a cycle")
    return order
