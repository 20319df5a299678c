"""The main job: ``python -m cannjax [demo|ops|bench]`` (also the ``cannjax`` script).

``demo`` (the default) trains a small GPT with cannjax and compares it with plain JAX
(:mod:`cannjax.demo`). ``ops`` prints every registered operator with its residuals and
the result of its self-check (:func:`cannjax.testing.check_op` at its sample and edge
points). ``bench`` runs the benchmark suites in ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from cannjax._src import demo
from cannjax._src.core.registry import registry
from cannjax._src.testing import check_op


def self_check(name: str) -> tuple[bool, str, float]:
    """Runs check_op on operator ``name`` at its sample and edge points, every config.

    Returns ``(passed, message, seconds)``.
    """
    spec = registry()[name]
    start = time.perf_counter()
    try:
        for cfg in spec.configs:
            check_op(spec, *spec.sample(jax.random.key(0)), **cfg)
        for case in spec.edges():
            # Under each config, with the case's own kwargs winning: once per distinct
            # remainder of the config (a last-axis case runs once, not once per axis).
            runs = {
                repr(sorted((k, v) for k, v in cfg.items() if k not in case.kwargs)): cfg
                for cfg in spec.configs
            }
            for cfg in runs.values():
                check_op(spec, *case.args, **case.check_kwargs(cfg))
    except (AssertionError, TypeError, ValueError) as e:
        return False, str(e).splitlines()[0], time.perf_counter() - start
    return True, "ok", time.perf_counter() - start


def _ops(args: argparse.Namespace) -> int:
    names = sorted(registry()) if not args.only else args.only
    unknown = [n for n in names if n not in registry()]
    if unknown:
        print(
            f"cannjax ops: unknown operator(s) {unknown}; known: {sorted(registry())}",
            file=sys.stderr,
        )
        return 2
    header = f"{'operator':<22}{'level':<11}{'reuse':<7}{'residuals':<28}{'check':<7}{'s':>6}"
    print(header)
    print("-" * len(header))
    failed = 0
    for name in names:
        spec = registry()[name]
        ok, msg, secs = self_check(name)
        failed += not ok
        res = ",".join(spec.residuals)
        reuse = ",".join(map(str, spec.reuse)) or "-"
        print(
            f"{name:<22}{spec.level.name:<11}{reuse:<7}{res:<28}{'ok' if ok else 'FAIL':<7}"
            f"{secs:6.1f}"
        )
        if not ok:
            print(f"    {msg}")
    print(
        f"\n{len(names) - failed} of {len(names)} operators passed their self-check "
        f"on {jax.default_backend()}"
    )
    return 1 if failed else 0


# The benchmark suites of a clone: cannjax/_src/cli.py -> <clone>/benchmarks.
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(args: argparse.Namespace) -> int:
    root = BENCHMARKS
    if not root.is_dir():
        print(
            "cannjax bench: benchmarks/ is not next to the package (run from a clone)",
            file=sys.stderr,
        )
        return 2
    scripts = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    code = 0
    for script in scripts:
        print(f"== {script.name}", flush=True)
        code |= subprocess.call([sys.executable, str(script), *args.extra])
    code |= subprocess.call([sys.executable, str(root / "_readme.py")])
    print(f"wrote {root / 'README.md'}")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="cannjax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    p_demo = sub.add_parser("demo", help="train a small GPT, compare with plain JAX (default)")
    demo.add_arguments(p_demo)
    p_ops = sub.add_parser("ops", help="list operators and run their self-check (default)")
    p_ops.add_argument("only", nargs="*", help="operator names (default: all)")
    p_bench = sub.add_parser("bench", help="run the benchmark suites in benchmarks/")
    p_bench.add_argument("extra", nargs=argparse.REMAINDER, help="passed to each suite")
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        if args.command is None:
            args = p_demo.parse_args([])
        try:
            return demo.run(args)
        except demo.DemoError as e:
            print(f"cannjax demo: {e}", file=sys.stderr)
            return 2
    if args.command == "ops":
        return _ops(args)
    return _bench(args)
