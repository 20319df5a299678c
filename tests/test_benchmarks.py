"""The benchmark suites and their harness: the interleaving order, the machine record,
what a suite does when a comparison it was asked for cannot run, the one torch pin, and
smoke runs of ``benchmarks/gpt.py`` and ``benchmarks/optimize.py`` (no timing asserted;
their results go to a temporary folder, never to ``benchmarks/results/``)."""

import hashlib
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tomllib
import types

import jax
import pytest

from benchmarks import _harness
from benchmarks import gpt as bench_gpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _pinned_torch() -> str:
    """The version pinned by pyproject.toml's ``torch`` extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = extras["optional-dependencies"]["torch"]
    name, _, version = requirement.partition("==")
    assert name == "torch" and re.fullmatch(r"\d+\.\d+\.\d+", version), requirement
    return version


# ---------------------------------------------------------------- the harness
def test_round_order_rotates_the_start_each_round():
    assert [_harness.round_order(3, r) for r in range(4)] == [
        [0, 1, 2],
        [1, 2, 0],
        [2, 0, 1],
        [0, 1, 2],
    ]
    assert _harness.round_order(1, 5) == [0] and _harness.round_order(0, 2) == []


def test_interleaved_times_rotates_the_order_of_the_candidates():
    calls = []
    fns = [lambda name=name: calls.append(name) for name in "ABC"]
    out = _harness.interleaved_times(fns, repeats=4, warmup=1, samples=True)
    warmup, rounds = calls[:3], calls[3:]
    assert warmup == ["A", "B", "C"]
    assert rounds == list("ABCBCACABABC")
    # Each candidate ran once a round; samples_s keeps the round index aligned.
    assert [r["n"] for r in out] == [4, 4, 4]
    assert all(len(r["samples_s"]) == 4 for r in out)


def test_machine_names_torch_only_where_the_suite_imported_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert "torch" not in _harness.machine()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="2.13.0+cpu"))
    assert _harness.machine()["torch"] == "2.13.0+cpu"


# ---------------------------------------------------------------- torch: asked, pinned
def test_gpt_torch_without_torch_exits_nonzero_before_writing(monkeypatch, tmp_path):
    # None in sys.modules makes `import torch` raise ImportError, as on a fresh machine.
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(bench_gpt, "write_results", lambda *a, **k: pytest.fail("wrote"))
    with pytest.raises(SystemExit) as exit_:
        bench_gpt.main(["--torch", "--smoke"])
    message = exit_.value.code
    assert isinstance(message, str)  # printed to stderr, exit status 1
    assert message.startswith("benchmarks/gpt.py --torch: PyTorch cannot be imported")
    assert f"torch=={_pinned_torch()}" in message and "make bench" in message


def test_gpt_reads_the_torch_pin_from_pyproject():
    assert bench_gpt.torch_requirement() == f"torch=={_pinned_torch()}"


# "torch==X", "torch X", "PyTorch X" (any case) with X a version.
_TORCH_VERSION = re.compile(r"(?i)\b(?:py)?torch\s*(?:==|\s)\s*v?(\d+\.\d+(?:\.\d+)?)")


def test_every_mention_of_a_torch_version_is_the_pin():
    texts = [ROOT / "pyproject.toml", ROOT / "Makefile", ROOT / "README.md"]
    for folder, pattern in [
        ("docs", "*.md"),
        ("benchmarks", "*.py"),
        ("benchmarks", "*.md"),
        ("cannjax", "*.py"),
    ]:
        texts += sorted((ROOT / folder).rglob(pattern))
    found = {
        f"{path.relative_to(ROOT)}: {m.group(0)}": m.group(1)
        for path in texts
        for m in _TORCH_VERSION.finditer(path.read_text())
    }
    assert "benchmarks/gpt.py: torch 2.13.0" in found  # the scan sees the docstring's
    assert {k: v for k, v in found.items() if v != _pinned_torch()} == {}


def _make_recipes(target: str) -> str:
    """What ``make TARGET`` would run from scratch (``-n -B``: print every recipe)."""
    r = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_bench_installs_torch_and_make_test_and_demo_do_not():
    installs = [line for line in _make_recipes("bench").splitlines() if "pip install" in line]
    assert any(re.search(r"\.\[[^]]*\btorch\b", line) for line in installs), installs
    for target in ("test", "demo"):
        assert "torch" not in _make_recipes(target), target


# ---------------------------------------------------------------- smoke runs
def _digest(folder: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _run_suite(script: str, args: list[str], results: pathlib.Path) -> str:
    """Runs ``benchmarks/SCRIPT`` with its results sent to ``results``; returns stdout."""
    committed = _digest(_harness.COMMITTED)
    env = {**os.environ, _harness.RESULTS_ENV: str(results), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert _digest(_harness.COMMITTED) == committed  # benchmarks/results/ untouched
    return r.stdout


@pytest.mark.slow
@pytest.mark.extended  # long; make test-extended (CI) runs it
@pytest.mark.parametrize("model,name", [("gpt", "gpt"), ("llama", "llama_step")])
def test_gpt_smoke_run(tmp_path, model, name):
    out = _run_suite("gpt.py", ["--smoke", "--model", model], tmp_path)
    rows = (
        "cannjax",
        "plain JAX",
        "cannjax bf16",
        "plain JAX bf16",
        "cannjax bf16, layer scan rolled",
    )
    for row in rows:
        assert f"| {row} | " in out
    assert "PyTorch" not in out  # no torch row unless asked
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(result["times_s"]) == set(rows) and result["smoke"]
    assert result["precision"]["cannjax bf16"] == "bfloat16"
    assert result["precision"]["cannjax bf16, layer scan rolled"] == "bfloat16"
    assert result["precision"]["plain JAX"] == "float32"
    assert result["grad_max_rel_difference"] < 1e-4
    assert result["grad_max_rel_difference_bf16"] < 0.1  # bf16 against bf16: rounding
    assert set(result["matmul_ceilings_gflops"]) == {"float32", "bfloat16"}
    assert "torch" not in result["machine"]
    assert (tmp_path / f"{name}.md").read_text().startswith("| step | precision | ms |")


@pytest.mark.slow
@pytest.mark.extended  # long; make test-extended (CI) runs it
@pytest.mark.skipif(not GLIBC, reason="keep_freed_memory sets glibc's allocator")
def test_gpt_keep_freed_smoke_run(tmp_path):
    out = _run_suite("gpt.py", ["--smoke", "--keep-freed"], tmp_path)
    assert "| cannjax bf16 | bfloat16 |" in out
    assert "keeping freed memory (`cannjax.backend.keep_freed_memory()`)" in out
    result = json.loads((tmp_path / "gpt_keep_freed.json").read_text())
    assert result["smoke"] and not (tmp_path / "gpt.json").exists()


def test_gpt_keep_freed_refuses_once_the_backend_has_started(monkeypatch):
    # This test process has run JAX already: the allocator can no longer be set, and the
    # suite must say so rather than time the default allocator under the keep-freed name.
    jax.numpy.zeros(1).block_until_ready()
    monkeypatch.setattr(bench_gpt, "write_results", lambda *a, **k: pytest.fail("wrote"))
    with pytest.raises(RuntimeError, match="keep_freed_memory: a JAX backend has already"):
        bench_gpt.main(["--smoke", "--keep-freed"])


def _optimize_smoke(tmp_path, models):
    out = _run_suite("optimize.py", ["--smoke", "--models", *models], tmp_path)
    result = json.loads((tmp_path / "optimize.json").read_text())
    assert result["command"].partition("benchmarks/optimize.py ")[2].startswith("--smoke")
    assert set(result["level2"]) == set(models)
    for name in models:
        assert "error" not in result["level2"][name], result["level2"][name]
        assert re.search(rf"^\| {name} \| \S+ (pass|FAIL) \|", out, re.M), name
    return out, result


@pytest.mark.slow
@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_optimize_smoke_run_plain_jax_mlp(tmp_path):
    # The plain-JAX model alone: the others take minutes even tiny (test below).
    _optimize_smoke(tmp_path, ["mlp"])


@pytest.mark.extended
def test_optimize_smoke_run_every_model(tmp_path):
    _, result = _optimize_smoke(tmp_path, ["nnx", "nnx_scan", "eqx", "mlp", "twin"])
    assert result["level2"]["twin"]["grads"]["allclose"]
    assert set(result["level3"]) == {"nnx_scan", "twin"}
    for r in result["level3"].values():
        assert "at checkpoint" in r["budgets"]


@pytest.mark.extended
def test_optimize_smoke_run_bf16_flax_models(tmp_path):
    _, result = _optimize_smoke(tmp_path, ["nnx_bf16", "nnx_scan_bf16"])
    assert set(result["matmul_ceilings_gflops"]) == {"float32", "bfloat16"}
    for name in ("nnx_bf16", "nnx_scan_bf16"):
        g = result["level2"][name]["grads"]
        # judged against the float32 model's gradient, beside the plain bf16 step's
        assert g["allclose"] and 0 < g["plain_vs_float32"] < 0.1, g


@pytest.mark.extended
def test_sharding_quick_run(tmp_path):
    out = _run_suite("sharding.py", ["--quick"], tmp_path)
    result = json.loads((tmp_path / "sharding.json").read_text())
    assert result["command"].endswith("benchmarks/sharding.py --quick")
    for model in ("gpt", "llama", "nnx", "nnx_scan"):
        for variants in result[model].values():
            for m in variants.values():
                assert m["collective_bytes"]["total"] > 0 and m["temp_bytes"] > 0
                assert m["grad_rel_to_single_device"] < 1e-4
    assert all(v["all_gathers"] == 0 for v in result["vocab"]["variants"].values())
    assert result["ring"]["grad_rel_at_T1024"] < 1e-4
    assert 0 < result["ring"]["memory_scheduler"]["temp_bytes"]
    assert "memory-minimizing scheduler" in out
    assert "| gpt | FSDP 4x2 | cannjax GPT |" in out and "paper" not in result


@pytest.mark.extended  # 25 s; tests/test_optimize_loss_forms.py checks the forms in make test
def test_optimize_losses_smoke_run(tmp_path):
    # Every loss spelling of the suite is found as linear_cross_entropy (fused with its
    # head) and keeps the plain gradients.
    _run_suite("optimize_losses.py", ["--smoke"], tmp_path)
    result = json.loads((tmp_path / "optimize_losses.json").read_text())
    assert result["command"].endswith("benchmarks/optimize_losses.py --smoke")
    for name, r in result["forms"].items():
        assert len(r["found"]) == 1 and r["found"][0].startswith("linear_cross_entropy"), name
        assert r["grad_rel_err"] < 1e-5, (name, r["grad_rel_err"])
        assert r["temp_bytes"][1] <= r["temp_bytes"][0], name


@pytest.mark.extended  # a profiled GPT step; make test-extended (CI) runs it
def test_profile_gpt_quick_run(tmp_path):
    # The step donates its state: the suite runs it as a training loop does (it once
    # called it again on donated buffers and failed).
    _run_suite("profile_gpt.py", ["--quick", "--model", "cannjax"], tmp_path)
    result = json.loads((tmp_path / "profile_gpt_cannjax.json").read_text())
    assert result["steps"] == 2 and result["span_ms"] > 0
    assert result["matmul_busy_ms"] + result["other_only_ms"] <= result["span_ms"] + 1e-6
    # The other ops by kind add up to their exclusive time, the operators' loops (attention's
    # block pairs) among them.
    kinds = result["other_by_kind_ms"]
    assert abs(sum(kinds.values()) - result["other_only_ms"]) <= 0.05 * result["other_only_ms"]
    assert any(k.startswith("operator loops: ") for k in kinds)


@pytest.mark.extended  # GPT and Llama steps timed; make test-extended (CI) runs it
def test_recompute_quick_run(tmp_path):
    _run_suite("recompute.py", ["--quick"], tmp_path)
    result = json.loads((tmp_path / "recompute.json").read_text())
    v = {(m["model"], m["variant"]): m for m in result["variants"]}
    gpt_new = v["gpt", "norms and gelu recomputed (the model)"]
    gpt_mid, gpt_old = v["gpt", "gelu recomputed, norms saved"], v["gpt", "all saved"]
    llama_new, llama_old = v["llama", "norms recomputed (the model)"], v["llama", "norms saved"]
    # Memory is deterministic: per layer, gelu's output [B, T, 4D] and the two norms'
    # outputs [B, T, D] (float32, 4 layers, batch 8, T 256, D 256) are no longer saved.
    layer = 4 * 8 * 256 * 256 * 4
    assert gpt_old["residual_bytes"] - gpt_mid["residual_bytes"] == 4 * layer
    rows = 4 * 8 * 256 * 4  # one float32 per row and layer: a norm's statistic
    assert 0 <= 2 * layer - (gpt_mid["residual_bytes"] - gpt_new["residual_bytes"]) <= rows
    assert llama_old["residual_bytes"] - llama_new["residual_bytes"] == 2 * layer
    assert gpt_new["temp_bytes"] < gpt_mid["temp_bytes"] < gpt_old["temp_bytes"]
    assert llama_new["temp_bytes"] < llama_old["temp_bytes"]
    assert all(m["grads_equal_baseline"] for m in result["variants"])


@pytest.mark.slow
@pytest.mark.extended  # 15 s; tests/test_dots.py checks the step's dot forms in make test
def test_dot_forms_smoke_run(tmp_path):
    out = _run_suite("dot_forms.py", ["--smoke"], tmp_path)
    result = json.loads((tmp_path / "dot_forms.json").read_text())
    assert result["smoke"] and set(result["ceilings"]) >= {"x @ w", "weight gradient x^T g"}
    # Every matrix product of the bf16 step re-timed, in the form the table gives.
    want = "bf16" if result["dot_table"]["cpu/bfloat16"] == "half" else "f32"
    assert result["step_dots"] and all(d["lhs"][0] == want for d in result["step_dots"])
    assert "| dot of the bf16 GPT step |" in out


@pytest.mark.extended  # about a minute; tests/test_preference.py and test_lora.py check the ops
def test_fine_tuning_smoke_run(tmp_path):
    # Every kind of preference loss and the LoRA step run, side by side with their plain
    # forms, with equal gradients (tiny sizes: the figures mean nothing).
    _run_suite("fine_tuning.py", ["--smoke"], tmp_path)
    result = json.loads((tmp_path / "fine_tuning.json").read_text())
    assert result["command"].endswith("benchmarks/fine_tuning.py --smoke")
    kinds = [r["kind"] for r in result["preference"]["by_kind"]]
    assert kinds == ["dpo", "orpo", "simpo", "cpo", "kto"]
    for r in result["preference"]["by_kind"]:
        assert r["grad_rel_diff"] < 1e-5, r
        assert r["ours_temp_bytes"] <= r["plain_temp_bytes"], r
    assert result["lora"]["adapter_grad_rel_diff"] < 1e-5
    assert result["lora"]["ours_temp_bytes"] <= result["lora"]["plain_temp_bytes"]


@pytest.mark.slow
@pytest.mark.extended  # child processes; make test-extended (CI) runs it
def test_host_memory_smoke_run(tmp_path):
    out = _run_suite("host_memory.py", ["--smoke"], tmp_path)
    result = json.loads((tmp_path / "host_memory.json").read_text())
    assert result["smoke"] and result["rounds"] == 1
    kept = {k: v for k, v in result["results"].items() if k.endswith("keep_freed_memory()")}
    assert set(kept) == {"float32, keep_freed_memory()", "bfloat16, keep_freed_memory()"}
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert all(v["applied"] == glibc for v in kept.values())
    assert "| bfloat16 | keep_freed_memory() |" in out


@pytest.mark.slow
def test_precision_convergence_smoke_run(tmp_path):
    _run_suite("precision_convergence.py", ["--smoke"], tmp_path)
    result = json.loads((tmp_path / "precision_convergence.json").read_text())
    runs = ("cannjax float32", "cannjax bfloat16", "plain JAX float32")
    assert set(result["held_out_loss"]) == set(runs)
    assert all(len(v) == 2 for v in result["held_out_loss"].values())  # two seeds
    # Four steps from the same weights: the three runs are still close.
    for r in runs[1:]:
        assert result["median_per_seed_distance"][r] < 0.01, result["median_per_seed_distance"]


@pytest.mark.slow
def test_bf16_bound_smoke_run(tmp_path):
    out = _run_suite("bf16_bound.py", ["--smoke"], tmp_path)
    result = json.loads((tmp_path / "bf16_bound.json").read_text())
    steps = ("flax.nnx", "flax.nnx, optimize", "plain-JAX twin", "plain-JAX twin, optimize")
    assert set(steps) < set(result["median_s"])
    assert "cannjax GPT (hand-written)" in result["median_s"]
    assert all(t > 0 for t in result["median_s"].values())
    assert result["smoke"] and result["target"] == 2.5
    assert "| cannjax GPT (hand-written) |" in out


@pytest.mark.slow
@pytest.mark.extended  # child processes; make test-extended (CI) runs it
def test_xla_dot_libraries_smoke_run(tmp_path):
    out = _run_suite("xla_dot_libraries.py", ["--smoke"], tmp_path)
    result = json.loads((tmp_path / "xla_dot_libraries.json").read_text())
    assert set(result["gflops"]) == {"no flag", "YNNPACK", "XNNPACK", "oneDNN"}
    dots = {"projection x w", "weight gradient x^T g", "attention q k^T", "attention p v"}
    assert all(set(v) == dots and min(v.values()) > 0 for v in result["gflops"].values())
    assert "| attention p v |" in out
