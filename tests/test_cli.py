"""The main job and the README example."""

import argparse
import io
import os
import pathlib
import re
import subprocess
import sys

import pytest

from cannjax._src import cli
from cannjax._src.cli import main
from cannjax._src.core.registry import registry

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The console script of this environment (pip install -e . puts it beside python).
SCRIPT = pathlib.Path(sys.executable).parent / "cannjax"


def test_ops_table_and_self_check(capsys):
    assert main(["ops", "exp", "relu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^exp\s+OUTPUT\s+0\s+out\s+ok", out, re.M)
    assert re.search(r"^relu\s+DERIVED\s+0\s+mask\s+ok", out, re.M)
    assert "2 of 2 operators passed" in out


@pytest.mark.extended  # logsumexp's and norm's full self-checks: 50-100 s on 2 cores
def test_ops_runs_edge_cases_under_the_configs_they_belong_to(capsys):
    # logsumexp's edge cases name axis=0 while its configs do too ("got multiple values
    # for keyword argument"), and norm's last-axis cases failed under {"axis": 0}.
    assert main(["ops", "logsumexp", "norm"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^logsumexp\s+DERIVED.*\sok\s", out, re.M)
    assert "2 of 2 operators passed" in out


# `cannjax ops NAME` for every operator runs with `make test-extended` (CI runs it after
# `make test`): it repeats check_op at the sample points that the operators' own test
# files run in `make test`, and adds the float32 edge points, which CI thus still checks.
# test_ops_table_and_self_check above runs the command itself in `make test`.
@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(registry()))
def test_ops_self_check_passes_for_every_operator(name):
    # `cannjax ops` over all operators, one per test so that pytest-xdist spreads them,
    # each as a user runs it: its float32 checks compare with plain autodiff of the
    # reference at float32 tolerances, so it runs with the user's XLA flags, not the
    # suite's cheaper codegen (conftest.py), which rounds some references differently.
    env = dict(os.environ, XLA_FLAGS=os.environ["CANNJAX_TEST_USER_XLA_FLAGS"])
    r = subprocess.run(
        [str(SCRIPT), "ops", name], capture_output=True, text=True, timeout=600, env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(rf"^{name}\s+[A-Z]+\s.*\sok\s", r.stdout, re.M), r.stdout
    assert "1 of 1 operators passed" in r.stdout


class _Flushes(io.StringIO):
    """A stdout that remembers what had been flushed when."""

    def __init__(self):
        super().__init__()
        self.flushed = ""

    def flush(self):
        self.flushed = self.getvalue()


def test_ops_shows_each_operator_as_its_check_starts(monkeypatch):
    # A self-check takes from seconds to minutes: the row of the operator being checked
    # is on the screen (flushed) while its check runs, then completed with its time.
    out = _Flushes()
    seen = []

    def check(name):
        seen.append(out.flushed)
        return True, "ok", 12.5

    monkeypatch.setattr(cli, "self_check", check)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["ops", "exp", "relu"]) == 0
    first, second = seen
    assert first.splitlines()[0].startswith("self-checking 2 operator(s), each from seconds")
    assert re.search(r"^exp\s+OUTPUT\s+0\s+out\s+$", first.splitlines()[-1])
    assert re.search(r"^exp\s+OUTPUT.*\sok\s+12\.5$", second.splitlines()[-2], re.M)
    assert re.search(r"^relu\s+DERIVED\s+0\s+mask\s+$", second.splitlines()[-1])
    assert out.flushed == out.getvalue()  # the summary too


def test_ops_help_states_how_long_it_takes(capsys):
    with pytest.raises(SystemExit):
        main(["ops", "--help"])
    out = capsys.readouterr().out
    assert "a few minutes" not in out
    assert re.search(r"every operator \(about \d+ minutes on 2 CPU cores\)", out)
    assert "seconds (exp: 2 s) to minutes (attention: 2.5 min)" in " ".join(out.split())


def test_every_option_of_every_command_shows_its_default(capsys):
    _, commands = cli.parser()
    for command, sub in commands.items():
        formatter = sub._get_formatter()
        options = [a for a in sub._actions if a.default is not argparse.SUPPRESS and a.help]
        assert options, command
        for action in options:
            text = formatter._expand_help(action)
            assert re.search(r"\(default: [^)]+\)$", text), f"cannjax {command}: {text!r}"
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = " ".join(capsys.readouterr().out.split())
        assert shown.count("(default: ") == len(options), shown
    demo_help = " ".join(commands["demo"].format_help().split())
    for default in ("(default: 1000)", "(default: gpt)", "(default: cannjax-demo)"):
        assert default in demo_help
    assert "report.html" in demo_help.split("options:")[0]  # the description says so


def test_ops_console_script_end_to_end():
    r = subprocess.run([str(SCRIPT), "ops", "relu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 of 1 operators passed" in r.stdout


def test_unknown_operator_is_a_clear_error(capsys):
    assert main(["ops", "exp", "gleu"]) == 2
    err = capsys.readouterr().err
    assert "cannjax ops: unknown operator 'gleu' (did you mean 'gelu'?); known: " in err
    assert "softmax" in err


def test_help_is_plain_text_with_one_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":mod:" not in out and ":func:" not in out
    assert out.count("default") == 1 and re.search(r"^\s+demo\s.*\(default\)", out, re.M)
    for command in ("demo", "ops", "bench"):
        assert re.search(rf"^\s+{command}\s+\w", out, re.M), command  # with its help
        with pytest.raises(SystemExit):
            main([command, "--help"])
        sub = capsys.readouterr().out
        assert f"usage: cannjax {command}" in sub and "``" not in sub


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"cannjax {__import__('cannjax').__version__}"


def test_bad_option_exits_nonzero_without_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "cannjax", "--nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "usage" in r.stderr


# tests/test_demo.py runs the same tiny demo (in float16) in `make test`.
@pytest.mark.extended
def test_demo_tiny_run_writes_report(tmp_path, capsys):
    out = tmp_path / "demo"
    args = [
        "demo",
        "--steps",
        "3",
        "--plain-steps",
        "2",
        "--width",
        "32",
        "--layers",
        "1",
        "--batch",
        "8",
        "--digits",
        "4",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(args) == 0
    report = __import__("json").loads((out / "report.json").read_text())
    assert report["grad_max_rel_difference"] < 1e-4
    assert len(report["runs"]["cannjax"]["losses"]) == 3
    assert report["memory"]["cannjax"]["temp_bytes"] > 0
    assert (out / "loss.png").exists() and (out / "memory.png").exists()
    assert "plain JAX step time / cannjax step time" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--width", "30", "--heads", "4"], "--heads=4 must divide --width=30"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--out", "/proc/cannjax-demo"], "--out /proc/cannjax-demo: cannot write there"),
        (["--mesh", "4by2"], "--mesh must be DATAxMODEL with two ints >= 1 (4x2), got '4by2'"),
        (["--mesh", "3x1", "--batch", "8"], "--mesh 3x1: its data axis (3) must divide --batch=8"),
        (["--mesh", "8x2"], "--mesh 8x2 needs 16 devices; this process has 8 (cpu)"),
    ],
)
def test_demo_bad_options_are_clear_errors(argv, message, capsys):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_demo_out_naming_a_file_says_so(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("keep me")
    assert main(["demo", "--out", str(readme)]) == 2
    err = capsys.readouterr().err
    assert f"--out {readme} is a file; --out names a folder" in err
    assert readme.read_text() == "keep me"


def test_bench_finds_the_suites_of_the_clone():
    suites = {p.name for p in cli.BENCHMARKS.glob("*.py")}
    assert cli.BENCHMARKS == pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    assert {"gpt.py", "ops.py", "_readme.py"} <= suites


def test_bench_list_names_every_suite_with_its_title(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    scripts = sorted(p.stem for p in cli.BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    assert [line.split()[0] for line in out.splitlines()] == scripts
    assert re.search(r"^fuse\s+cannjax\.fuse against plain JAX", out, re.M)
    # Plain text for a user: no reST markup, no references to the project's issues.
    assert "`" not in out and not re.search(r":(func|mod|class):", out)
    assert not re.search(r"\bissues? ?#?\d+", out, re.I), out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["zzz"], "cannjax bench: unknown suite 'zzz'; known: amp, "),
        (["fus"], "unknown suite 'fus' (did you mean 'fuse'?)"),
        (["--quick", "--write"], "--quick runs are never recorded there"),
    ],
)
def test_bench_bad_arguments_are_clear_errors(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def _fake_benchmarks(root: pathlib.Path, suites: dict[str, str]) -> pathlib.Path:
    """A benchmarks/ folder with this clone's _harness.py and _readme.py, and ``suites``."""
    root.mkdir()
    for helper in ("_harness.py", "_readme.py"):
        (root / helper).write_text((cli.BENCHMARKS / helper).read_text())
    for name, body in suites.items():
        (root / f"{name}.py").write_text(f'"""Suite {name}."""\n{body}')
    return root


# Writes its options (``--quick`` among them) where the bench command asked.
RECORDS = """
import os, pathlib, sys
out = pathlib.Path(os.environ["CANNJAX_BENCH_RESULTS"])
(out / (pathlib.Path(__file__).stem + ".md")).write_text(" ".join(sys.argv[1:]) or "-")
"""


def test_bench_passes_options_and_writes_where_asked(tmp_path, monkeypatch, capsys):
    bench = _fake_benchmarks(tmp_path / "benchmarks", {"rec": RECORDS + '# "--quick"\n'})
    monkeypatch.setattr(cli, "BENCHMARKS", bench)
    out = tmp_path / "out"
    assert main(["bench", "--quick", "rec", "--out", str(out)]) == 0
    assert (out / "results" / "rec.md").read_text() == "--quick"
    assert (out / "README.md").read_text().startswith("# Benchmarks")
    assert not (bench / "results").exists() and not (bench / "README.md").exists()
    assert f"wrote {out / 'README.md'}" in capsys.readouterr().out


def test_bench_fails_when_a_suite_fails_and_writes_no_readme(tmp_path, monkeypatch, capsys):
    bench = _fake_benchmarks(
        tmp_path / "benchmarks", {"bad": "raise SystemExit(3)\n", "rec": RECORDS}
    )
    monkeypatch.setattr(cli, "BENCHMARKS", bench)
    out = tmp_path / "out"
    assert main(["bench", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "1 suite run(s) failed: bad (python benchmarks/bad.py: exit 3)" in captured.err
    assert "wrote" not in captured.out and not (out / "README.md").exists()
    assert (out / "results" / "rec.md").read_text() == "-"  # the other suite still ran


def test_a_suite_run_directly_does_not_write_the_committed_results():
    env = {k: v for k, v in __import__("os").environ.items() if k != "CANNJAX_BENCH_RESULTS"}
    code = "import _harness; print(_harness.RESULTS); print(_harness.COMMITTED)"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=cli.BENCHMARKS,
        env=env,
        timeout=120,
    )
    results, committed = r.stdout.split()
    assert committed == str(cli.BENCHMARKS / "results")
    assert results == str(ROOT / "build" / "bench" / "results")


@pytest.mark.slow
@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_bench_quick_fuse_leaves_the_checkout_clean():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    status = ["git", "status", "--porcelain"]
    before = subprocess.run(status, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    r = subprocess.run(
        [str(SCRIPT), "bench", "--quick", "fuse"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"wrote {ROOT / 'build' / 'bench' / 'README.md'}" in r.stdout
    after = subprocess.run(status, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert after == before
