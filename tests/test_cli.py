"""The main job and the README example."""

import pathlib
import re
import subprocess
import sys

import pytest

from cannjax._src.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ops_table_and_self_check(capsys):
    assert main(["ops", "exp", "relu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^exp\s+OUTPUT\s+0\s+out\s+ok", out, re.M)
    assert re.search(r"^relu\s+DERIVED\s+0\s+mask\s+ok", out, re.M)
    assert "2 of 2 operators passed" in out


def test_ops_runs_edge_cases_under_the_configs_they_belong_to(capsys):
    # logsumexp's edge cases name axis=0 while its configs do too ("got multiple values
    # for keyword argument"), and norm's last-axis cases failed under {"axis": 0}.
    assert main(["ops", "logsumexp", "norm"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^logsumexp\s+DERIVED.*\sok\s", out, re.M)
    assert "2 of 2 operators passed" in out


def test_unknown_operator_is_a_clear_error(capsys):
    assert main(["ops", "nope"]) == 2
    assert "unknown operator(s) ['nope']" in capsys.readouterr().err


def test_bad_option_exits_nonzero_without_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "cannjax", "--nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "usage" in r.stderr


@pytest.mark.slow
def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(block, "README.md", "exec"), {})


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
    ],
)
def test_demo_bad_options_are_clear_errors(argv, message, capsys):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_finds_the_suites_of_the_clone():
    from cannjax._src import cli

    suites = {p.name for p in cli.BENCHMARKS.glob("*.py")}
    assert cli.BENCHMARKS == pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    assert {"gpt.py", "ops.py", "_readme.py"} <= suites
