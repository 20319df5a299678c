"""optimize's finders: each ``find(graph, eqn index) -> Replacement | Miss | None`` reads
the program through :mod:`cannjax._src.core.graph` and says whether the equation ends an
idiom (a :class:`~cannjax._src.optimization.replacement.Replacement`), ends something
that looks like one but is not (a :class:`~cannjax._src.optimization.replacement.Miss`,
with the reason), or neither (None). The planner (:mod:`..rewrite`) runs them in priority
order."""
