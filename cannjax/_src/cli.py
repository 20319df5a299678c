"""The main job: ``python -m cannjax [demo|ops|bench]``, also the ``cannjax`` script.

``demo`` (the default) trains a small GPT with cannjax and compares it with plain JAX
(:mod:`cannjax._src.demo`). ``ops`` prints every registered operator with its residuals
and the result of its self-check (:func:`cannjax.testing.check_op` at its sample and edge
points, under each of its configs). ``bench`` runs the benchmark suites in
``benchmarks/`` of a clone; only ``bench --write`` touches the committed results.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from cannjax._src import demo
from cannjax._src.core.registry import registry
from cannjax._src.testing import check_op

# What `cannjax --help` prints: plain text for a terminal (the docstring above is for
# the API docs).
DESCRIPTION = """\
cannjax: gradient engineering for JAX (operators with hand-written backward rules,
fusion, rematerialization, loss scaling). Without a command, runs the demo.
"""
EPILOG = "Run `cannjax COMMAND --help` for the options of a command."
DEMO = """\
Trains a small GPT (or, with --model llama, a Llama-style decoder) on a synthetic
sorting task with cannjax, then the same model in plain JAX, as written and through
cannjax.optimize, and compares losses, gradients, step time and memory side by side.
Prints the comparison table, and writes to --out: report.html (one page with the
table and the plots; open it in a browser), report.json (every figure) and the plots
loss.png and memory.png.
"""
OPS = """\
Prints each registered operator with its gradient level, the inputs it may reuse and
its residuals, and runs its self-check: cannjax.testing.check_op at its sample point
under every config, and at each edge point under the configs it belongs to.
Each row is printed as its operator's check starts and completed with the check's
result and time. Exits 1 if a check fails, 2 on an unknown name.
"""
# How long `cannjax ops` takes, measured on a 2-core x86 CPU (jax 0.10.2): exp 2.4 s,
# gelu 12 s, attention 148 s on an idle machine; all 40 operators 22 minutes on a busy one.
OPS_EACH = "from seconds (exp: 2 s) to minutes (attention: 2.5 min) on 2 CPU cores"
OPS_ALL = "about 20 minutes on 2 CPU cores"
BENCH = """\
Runs the benchmark suites in benchmarks/ of a clone, each in its own process, then
assembles a README from their tables. Results go to build/bench/ (or --out); only
--write replaces the committed results in benchmarks/results/ and benchmarks/README.md.
Exits 1 if a suite fails (nothing is assembled then), 2 on bad options.
"""


def self_check(name: str) -> tuple[bool, str, float]:
    """Runs check_op on operator ``name`` at its sample and edge points, every config.

    Each edge case runs under the configs it belongs to: its own keyword arguments win
    over a config's (a last-axis case is not run with ``axis=0``), once per distinct
    remainder of the configs.

    Returns:
      ``(passed, message, seconds)``; ``message`` is the first line of the first failure.
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
    except Exception as e:  # a crash is a failed check too; report it and go on
        first = (str(e).splitlines() or [""])[0]
        return False, f"{type(e).__name__}: {first}", time.perf_counter() - start
    return True, "ok", time.perf_counter() - start


def _unknown(kind: str, names: Sequence[str], known: Sequence[str]) -> str:
    """``unknown operator 'gleu' (did you mean 'gelu'?); known: ...``."""
    parts = []
    for n in names:
        close = difflib.get_close_matches(n, known, n=1)
        parts.append(repr(n) + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural = "s" if len(names) > 1 else ""
    return f"unknown {kind}{plural} {', '.join(parts)}; known: {', '.join(known)}"


def _ops(args: argparse.Namespace) -> int:
    known = sorted(registry())
    names = list(dict.fromkeys(args.names)) or known
    unknown = [n for n in names if n not in registry()]
    if unknown:
        print(f"cannjax ops: {_unknown('operator', unknown, known)}", file=sys.stderr)
        return 2
    # The residuals column is as wide as the longest list, so that "ok" never runs into it.
    wide = max([27] + [len(",".join(registry()[n].residuals)) for n in names]) + 1
    named = max([21] + [len(n) for n in names]) + 1  # likewise the names
    header = (
        f"{'operator':<{named}}{'level':<11}{'reuse':<7}{'residuals':<{wide}}{'check':<7}{'s':>6}"
    )
    print(f"self-checking {len(names)} operator(s), each {OPS_EACH}", flush=True)
    print(header)
    print("-" * len(header), flush=True)
    failed = 0
    for name in names:
        spec = registry()[name]
        res = ",".join(spec.residuals)
        reuse = ",".join(map(str, spec.reuse)) or "-"
        # The row's first columns go out before the check runs, so that a terminal (or a
        # log followed with tail -f) shows which operator is being checked.
        print(f"{name:<{named}}{spec.level.name:<11}{reuse:<7}{res:<{wide}}", end="", flush=True)
        ok, msg, secs = self_check(name)
        failed += not ok
        print(f"{'ok' if ok else 'FAIL':<7}{secs:6.1f}", flush=True)
        if not ok:
            print(f"    {msg}")
    print(
        f"\n{len(names) - failed} of {len(names)} operators passed their self-check "
        f"on {jax.default_backend()}",
        flush=True,
    )
    return 1 if failed else 0


# The benchmark suites of a clone: cannjax/_src/cli.py -> <clone>/benchmarks.
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Names the folder a suite writes its results to (read by benchmarks/_harness.py).
RESULTS_ENV = "CANNJAX_BENCH_RESULTS"


def _suites(root: Path) -> dict[str, Path]:
    """Suite name -> script: every ``benchmarks/*.py`` not starting with ``_``."""
    return {p.stem: p for p in sorted(root.glob("*.py")) if not p.name.startswith("_")}


# reST markup of a docstring: ``code``, `text`, :func:`name` (the API docs render it).
_MARKUP = re.compile(r"(?::[\w:]+:)?`{1,2}([^`]+?)`{1,2}")


def _plain(text: str) -> str:
    """``text`` without its reST markup, for a terminal.

    Example:
      >>> _plain("``cannjax.fuse`` against :func:`jax.grad`")
      'cannjax.fuse against jax.grad'
    """
    return _MARKUP.sub(r"\1", text)


def _title(script: Path) -> str:
    """The first line of a suite's docstring, as plain text."""
    doc = ast.get_docstring(ast.parse(script.read_text(), str(script))) or ""
    return _plain(doc.strip().splitlines()[0]) if doc.strip() else "(no docstring)"


def _readme_module(root: Path):
    """``benchmarks/_readme.py``: the recorded command of each result, and the README."""
    spec = importlib.util.spec_from_file_location("_cannjax_bench_readme", root / "_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs(script: Path, recorded: Sequence[str], quick: bool) -> list[list[str]]:
    """The option lists ``script`` runs with: ``--quick`` once, or its recorded commands."""
    if quick:
        # A suite without a --quick mode runs as it is (its argparse would reject it).
        return [["--quick"]] if '"--quick"' in script.read_text() else [[]]
    runs: list[list[str]] = []
    for cmd in recorded:
        words = cmd.split()
        if words and Path(words[0]).name == script.name and words[1:] not in runs:
            runs.append(words[1:])
    return runs or [[]]


def _bench(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"cannjax bench: {message}", file=sys.stderr)
        return 2

    root = BENCHMARKS
    if not (root / "_harness.py").is_file():
        return fail(
            f"no benchmark suites at {root}: they live in benchmarks/ of a clone of the "
            "repository; run cannjax bench from a clone installed with pip install -e ."
        )
    suites = _suites(root)
    if args.list:
        width = max(map(len, suites)) + 2
        for name, script in suites.items():
            print(f"{name:<{width}}{_title(script)}")
        return 0
    unknown = [s for s in args.suites if s not in suites]
    if unknown:
        return fail(_unknown("suite", unknown, list(suites)))
    if args.write and args.quick:
        return fail(
            "--write records the full runs in benchmarks/results/, and --quick runs are "
            "never recorded there: drop --quick to record, or --write to try it out"
        )
    if args.write and args.out is not None:
        return fail(f"--out {args.out} is for runs without --write (which go to benchmarks/)")
    readme = _readme_module(root)
    if args.write:
        results = root / "results"
    else:
        results = (args.out or root.parent / "build" / "bench").resolve() / "results"
    try:
        results.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return fail(f"--out {args.out}: cannot create {results} ({e.strerror or e})")
    env = dict(os.environ)
    env[RESULTS_ENV] = str(results)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root.parent), env.get("PYTHONPATH")]))
    failed = []
    for name in dict.fromkeys(args.suites) or suites:
        script = suites[name]
        for opts in _runs(script, [cmd for _, _, cmd in readme.SUITES], args.quick):
            shown = " ".join([f"benchmarks/{script.name}", *opts])
            print(f"== {name}: python {shown}", flush=True)
            code = subprocess.call([sys.executable, str(script), *opts], env=env, cwd=root.parent)
            if code:
                failed.append(f"{name} (python {shown}: exit {code})")
    if failed:
        print(
            f"cannjax bench: {len(failed)} suite run(s) failed: {'; '.join(failed)}. "
            f"No README written; the results of the runs that passed are in {results}",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {readme.write(results)} from the results in {results}")
    if not args.write:
        print("not the committed results: cannjax bench --write records full runs there")
    return 0


def _version() -> str:
    try:
        return importlib.metadata.version("cannjax")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown (not installed)"


class _Help(argparse.RawDescriptionHelpFormatter):
    """The commands' help: descriptions as written, every option's default shown.

    argparse.ArgumentDefaultsHelpFormatter's rule, except that a help text stating its
    default itself (``(default: all)``) keeps it, and a flag's default reads ``off``.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS:
            return text
        return text + (" (default: off)" if action.nargs == 0 else " (default: %(default)s)")


def parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``cannjax`` command line: its parser, and each command's parser by name."""
    top = argparse.ArgumentParser(
        prog="cannjax",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=f"cannjax {_version()}")
    sub = top.add_subparsers(dest="command", title="commands")
    p_demo = sub.add_parser(
        "demo",
        help="compare cannjax and plain JAX on a small GPT (default)",
        description=DEMO,
        formatter_class=_Help,
    )
    demo.add_arguments(p_demo)
    p_ops = sub.add_parser(
        "ops",
        help="list the operators and run their self-checks",
        description=OPS,
        formatter_class=_Help,
        epilog=f"examples:\n  cannjax ops              every operator ({OPS_ALL})\n"
        "  cannjax ops exp relu     two quick ones (seconds)\n\n"
        f"One operator's self-check takes {OPS_EACH}.",
    )
    p_ops.add_argument("names", nargs="*", metavar="NAME", help="operators to check (default: all)")
    p_bench = sub.add_parser(
        "bench",
        help="run the benchmark suites of a clone (benchmarks/)",
        description=BENCH,
        formatter_class=_Help,
        epilog="examples:\n  cannjax bench --list\n  cannjax bench --quick fuse      seconds; "
        "writes build/bench/\n  cannjax bench --write           the full runs, recorded "
        "(make bench)",
    )
    p_bench.add_argument(
        "suites", nargs="*", metavar="SUITE", help="suites to run (default: all; see --list)"
    )
    p_bench.add_argument("--list", action="store_true", help="list the suites and exit")
    p_bench.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats: seconds to a minute per suite, for trying things",
    )
    p_bench.add_argument(
        "--write",
        action="store_true",
        help="run each suite as recorded in benchmarks/README.md and replace the committed "
        "results (benchmarks/results/, benchmarks/README.md)",
    )
    p_bench.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where results go without --write (default: build/bench/ in the clone)",
    )
    return top, {"demo": p_demo, "ops": p_ops, "bench": p_bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    top, commands = parser()
    args = top.parse_args(argv)
    if args.command in (None, "demo"):
        if args.command is None:
            args = commands["demo"].parse_args([])
        try:
            return demo.run(args)
        except demo.DemoError as e:
            print(f"cannjax demo: {e}", file=sys.stderr)
            return 2
    if args.command == "ops":
        return _ops(args)
    return _bench(args)
