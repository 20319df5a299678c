"""The demo (``python -m cannjax demo``): progress, memory per precision, plots, report.html."""

import argparse
import contextlib
import io
import json
import re

import jax
import numpy as np
import pytest

from cannjax._src import demo
from cannjax._src.cli import main
from cannjax._src.models import gpt
from cannjax._src.models.tasks import SortTask

# The smallest settings that still train a GPT (as tests/test_cli.py runs the demo).
TINY = ["--steps", "3", "--plain-steps", "2", "--width", "32", "--layers", "1"]
TINY += ["--batch", "8", "--digits", "4", "--quiet"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _feed(progress, steps):
    with progress:
        for i in range(steps):
            progress.update(i + 1, loss=1.0 / (i + 1), tok_s=1234.0)


def test_progress_on_a_terminal_is_a_tqdm_bar():
    out = _Terminal()
    _feed(demo.Progress("cannjax", 50, stream=out), 50)
    text = out.getvalue()
    assert "\r" in text and text.count("\n") == 1  # redrawn in place, one final newline
    last = text.split("\r")[-1]
    assert "cannjax" in last and "50/50" in last and "100%" in last
    assert "loss 0.0200" in last and "1,234 tok/s" in last


@pytest.mark.parametrize(
    "steps,shown",
    [
        (1000, list(range(100, 1001, 100))),
        (25, [3, 5, 8, 10, 13, 15, 18, 20, 23, 25]),
        (7, list(range(1, 8))),
    ],
)
def test_progress_without_a_terminal_prints_a_line_per_tenth(steps, shown):
    out = io.StringIO()  # a log file or a pipe
    _feed(demo.Progress("plain JAX", steps, stream=out), steps)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [int(re.match(r"plain JAX: step (\d+)/", ln).group(1)) for ln in lines] == shown
    assert lines[-1] == f"plain JAX: step {steps}/{steps} (100%), loss {1 / steps:.4f}, 1,234 tok/s"


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal])
def test_quiet_progress_writes_nothing(stream):
    out = stream()
    _feed(demo.Progress("cannjax", 20, stream=out, enabled=False), 20)
    assert out.getvalue() == ""


def test_memory_is_measured_in_the_precision_run():
    task = SortTask(digits=4)
    cfg = gpt.GPTConfig(
        vocab=task.vocab, width=32, heads=2, layers=1, seq_len=task.seq_len, remat="none"
    )
    params = gpt.init_gpt(jax.random.key(0), cfg)
    args = argparse.Namespace(steps=1, lr=1e-3, seed=0, batch=8, quiet=True)
    mem = {
        p: demo._train("cannjax", gpt.gpt_loss, params, cfg, task, args, 1, p)[2]
        for p in ("float32", "float16")
    }
    assert mem["float16"]["precision"] == "float16"
    # float16 activations: the residuals shrink; the compiled step is another program.
    assert mem["float16"]["residual_bytes"] < mem["float32"]["residual_bytes"]
    assert mem["float16"]["temp_bytes"] != mem["float32"]["temp_bytes"]


def test_plots_have_titles_labels_distinct_styles_and_values(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    monkeypatch.setattr(plt, "close", lambda *a: None)  # keep the figures to look at
    before = set(plt.get_fignums())
    runs = {
        "cannjax": {"losses": [2.0 / (i + 1) for i in range(100)]},
        "plain JAX": {"losses": [2.0 / (i + 1) for i in range(20)]},
    }
    mem = {
        "cannjax": {"precision": "float16", "temp_bytes": 3 * 2**20, "residual_bytes": 2**20},
        "plain JAX": {"precision": "float32", "temp_bytes": 5 * 2**20, "residual_bytes": 2**21},
    }
    assert demo._plots(tmp_path, runs, mem) == ["loss.png", "memory.png"]
    loss_fig, mem_fig = (plt.figure(n) for n in sorted(set(plt.get_fignums()) - before))
    try:
        assert "cannjax vs plain JAX" in loss_fig.get_suptitle()
        full, both = loss_fig.axes  # the whole run, then the steps both runs made
        assert both.get_xlim()[1] < 25 < full.get_xlim()[1]
        for ax in (full, both):
            assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
            c, p = ax.get_lines()
            assert c.get_linestyle() != p.get_linestyle() and p.get_marker() not in ("", "None")
        (legend,) = loss_fig.legends  # one for both panels
        assert {t.get_text() for t in legend.get_texts()} == {
            "cannjax (float16)",
            "plain JAX (float32)",
        }
        (ax,) = mem_fig.axes
        assert ax.get_title() and ax.get_ylabel() == "MiB"
        values = {t.get_text() for t in ax.texts}
        assert {"3.00", "1.00", "5.00", "2.00"} <= values  # every bar carries its value
        assert (tmp_path / "loss.png").stat().st_size > 0
    finally:
        plt.close(loss_fig)
        plt.close(mem_fig)


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("precisions", [("float32",) * 3, ("bfloat16", "float32", "float32")])
@pytest.mark.parametrize("plain_steps", [20, 100])
def test_plot_legends_sit_off_the_data(tmp_path, monkeypatch, plain_steps, precisions):
    # A legend inside the axes covered the curves' start (the loss plot) or the bars'
    # value labels (the memory plot): each legend now lies outside every axes, within the
    # figure, in the saved image too.
    plt = pytest.importorskip("matplotlib.pyplot")
    monkeypatch.setattr(plt, "close", lambda *a: None)
    before = set(plt.get_fignums())
    names = ["cannjax", "plain JAX", demo.OPTIMIZED]
    runs = {
        n: {"losses": [2.0 / (i + 1) for i in range(100 if i == 0 else plain_steps)]}
        for i, n in enumerate(names)
    }
    mem = {
        n: {"precision": p, "temp_bytes": (3 + i) * 2**20, "residual_bytes": (1 + i) * 2**20}
        for i, (n, p) in enumerate(zip(names, precisions))
    }
    demo._plots(tmp_path, runs, mem)
    figs = [plt.figure(n) for n in sorted(set(plt.get_fignums()) - before)]
    try:
        for fig in figs:
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
            assert len(legends) == 1, fig.get_suptitle()
            box = legends[0].get_window_extent(renderer)
            for ax in fig.axes:
                assert not _overlap(box, ax.get_window_extent(renderer)), ax.get_title()
            assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1  # not cut off
            assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    finally:
        for fig in figs:
            plt.close(fig)


def test_held_out_loss_is_the_loss_on_one_fixed_batch_of_n_sequences():
    task = SortTask(digits=4)
    cfg = gpt.GPTConfig(vocab=task.vocab, width=32, heads=2, layers=1, seq_len=task.seq_len)
    params = gpt.init_gpt(jax.random.key(0), cfg)
    key = jax.random.key(3)
    held = demo._held_out_loss(gpt.gpt_loss, params, cfg, task, key, n=64)
    b = task.batch(key, 64)
    direct = float(gpt.gpt_loss(params, b.tokens, b.targets, cfg, b.weights))
    assert held == pytest.approx(direct, rel=1e-6)
    other = task.batch(jax.random.key(4), 64)  # another batch gives another loss
    assert float(gpt.gpt_loss(params, other.tokens, other.targets, cfg, other.weights)) != held


@pytest.fixture(scope="module")
def float16_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        argv = ["demo", *TINY, "--precision", "float16", "--variable-length", "--mesh", "4x2"]
        argv += ["--out", str(out)]
        assert main(argv) == 0
    return out, buf.getvalue()


@pytest.mark.extended  # the float16, variable-length, 4x2-mesh demo run: 40 s
def test_demo_table_and_legend_are_printed_aligned(float16_demo):
    _, text = float16_demo
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("model"))
    head, rule, row_c, row_f, row_p, row_o = lines[i : i + 6]
    assert head.split() == [
        "model",
        "precision",
        "step",
        "ms",
        "temp",
        "MiB",
        "residual",
        "MiB",
        "loss@2",
    ]
    assert row_c.startswith("cannjax ") and " float16 " in row_c
    # A half-precision demo also trains cannjax in float32, beside it.
    assert row_f.startswith(demo.F32_RUN + " ") and " float32 " in row_f
    assert row_p.startswith("plain JAX ") and " float32 " in row_p
    assert row_o.startswith(demo.OPTIMIZED + " ") and " float32 " in row_o
    # Aligned: every column ends (numbers, right-aligned) where the rule's dashes end.
    ends = [m.end() for m in re.finditer(r"-+", rule)]
    for row in (row_c, row_f, row_p, row_o):
        assert [m.end() for m in re.finditer(r"\S+", row)][-4:] == ends[-4:]
    for column in ("precision", "step ms", "temp MiB", "residual MiB", "loss@2"):
        assert re.search(rf"^{re.escape(column)}  +\S", text, re.M), column
    assert "MiB (2**20 bytes)" in text and "training loss at step 2" in text


@pytest.mark.extended  # the float16, variable-length, 4x2-mesh demo run: 40 s
def test_demo_writes_report_html_with_table_and_plots(float16_demo):
    out, text = float16_demo
    report = json.loads((out / "report.json").read_text())
    assert report["memory"]["cannjax"]["precision"] == "float16"
    assert report["memory"]["plain JAX"]["precision"] == "float32"
    assert report["memory"][demo.F32_RUN]["precision"] == "float32"
    assert report["memory"][demo.OPTIMIZED]["precision"] == "float32"
    # The two precisions are compared by the loss on one held-out batch.
    comparison = report["precision_comparison"]
    assert set(comparison) == {"held_out_loss", "held_out_loss_float32", "accuracy_float32"}
    held, held_f32 = comparison["held_out_loss"], comparison["held_out_loss_float32"]
    assert f"held-out loss {held:.4f} vs {held_f32:.4f}" in text
    # The optimized plain-JAX run trains the same model on the same data as plain JAX.
    plain, optimized = (report["runs"][k]["losses"] for k in ("plain JAX", demo.OPTIMIZED))
    assert len(optimized) == len(plain) == 2
    assert optimized == pytest.approx(plain, rel=1e-4)
    assert report["grad_max_rel_difference_optimized"] < 1e-5
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and str(out / "report.html") in text
    assert "<caption>cannjax vs plain JAX</caption>" in page
    for cell in ("<th>temp MiB</th>", "<th>residual MiB</th>", "<td>float16</td>",
                 f"<td>{demo.OPTIMIZED}</td>"):  # fmt: skip
        assert cell in page, cell
    assert "<caption>what the columns mean</caption>" in page
    assert "XLA&#x27;s scratch memory" in page  # the legend, escaped
    assert "max rel. difference" in page
    images = re.findall(
        r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="(\w+\.png)"', page
    )
    assert [alt for _, alt in images] == ["loss.png", "memory.png"]
    assert all(len(data) > 1000 for data, _ in images)  # embedded: the page stands alone


def test_variable_length_is_off_by_default():
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert p.parse_args([]).variable_length is False
    assert p.parse_args(["--variable-length"]).variable_length is True


@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_variable_length_run_compiles_once_per_gear():
    task = SortTask(digits=8)
    cfg = gpt.GPTConfig(
        vocab=task.vocab, width=16, heads=2, layers=1, seq_len=task.seq_len, remat="none"
    )
    params = gpt.init_gpt(jax.random.key(0), cfg)
    args = argparse.Namespace(steps=16, lr=1e-3, seed=0, batch=4, digits=8, quiet=True)
    lengths = 2 * demo._variable_digits(args)
    assert len(set(lengths.tolist())) > demo.GEARS  # without gears: more programs
    var = demo._train_variable(gpt.gpt_loss, params, cfg, task, args)
    assert var["distinct_lengths"] == len(set(lengths.tolist()))
    assert var["compiled"] <= demo.GEARS and len(var["gears"]) <= demo.GEARS
    assert var["gears"][-1] == cfg.seq_len
    assert 0 <= var["overhead"] < var["pad_all_overhead"]
    assert len(var["losses"]) == 16 and all(np.isfinite(var["losses"]))


@pytest.mark.extended  # the float16, variable-length, 4x2-mesh demo run: 40 s
def test_demo_variable_length_table_and_report(float16_demo):
    out, text = float16_demo
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("run "))
    head, _, fixed, variable = lines[i : i + 4]
    assert "programs compiled" in head and "padding overhead" in head
    assert fixed.startswith("fixed length ") and variable.startswith("variable, ")
    var = json.loads((out / "report.json").read_text())["variable_length"]
    assert 1 <= var["compiled"] <= min(demo.GEARS, var["distinct_lengths"])
    assert len(var["losses"]) == 3 and var["overhead"] >= 0
    assert f"{var['compiled']} programs compiled" in text
    assert "variable length: 3 steps" in (out / "report.html").read_text()


@pytest.mark.extended  # the float16, variable-length, 4x2-mesh demo run: 40 s
def test_demo_sharded_run_prints_memory_and_collectives_per_device(float16_demo):
    # --mesh 4x2: the cannjax run's first steps again, FSDP over 4 and tensor parallel
    # over 2 of the 8 host devices (conftest.py), on the same batches.
    out, text = float16_demo
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("run ") and "collectives" in ln)
    head, _, one, sharded = lines[i : i + 4]
    assert head.split()[:4] == ["run", "devices", "params+state", "MiB"]
    assert one.split()[:2] == ["cannjax", "1"] and sharded.split()[:3] == ["cannjax", "4x2", "8"]
    sh = json.loads((out / "report.json").read_text())["sharded"]
    assert sh["mesh"] == [4, 2] and len(sh["losses"]) == 2
    assert sh["loss_max_rel_difference"] < 1e-3  # float16 compute, other reduction orders
    assert sh["sharded"]["temp_bytes"] < sh["one_device"]["temp_bytes"]
    assert sh["sharded"]["state_bytes"] < sh["one_device"]["state_bytes"]
    assert sh["sharded"]["collective_bytes"] > 0 == sh["one_device"]["collective_bytes"]
    assert "sharded over 4x2 devices" in (out / "report.html").read_text()
