"""Backends: Ascend export golden check, plugin discovery, info(), platform policies.

Nothing here compiles for Ascend: the Ascend module is lowered (exported) only, and the
CPU branch of the same module runs.
"""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

import cannjax
import cannjax_ascend_plugin
from cannjax import backend
from cannjax.backend import ascend
from cannjax.core import defop, register_kernel, unregister_kernel
from tests import _rng as rand
from tests._tables import table_cells

ROOT = pathlib.Path(__file__).resolve().parents[1]
X = jnp.linspace(-3.0, 3.0, 12, dtype=jnp.float32).reshape(3, 4)
ASCEND_OPS = ("gelu", "silu", "sigmoid", "tanh", "exp", "relu", "softplus")
PLAIN = types.SimpleNamespace(
    gelu=jax.nn.gelu,
    silu=jax.nn.silu,
    sigmoid=jax.nn.sigmoid,
    tanh=jnp.tanh,
    exp=jnp.exp,
    relu=jax.nn.relu,
    softplus=jax.nn.softplus,
)


@pytest.fixture(autouse=True)
def ascend_entries():
    """The Ascend entries installed (as on an Ascend host, or after ascend.install())."""
    was = ascend.config().enabled
    ascend.install()
    yield
    if not was:
        ascend.uninstall()


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _net(ops, x):
    y = x
    for name in ASCEND_OPS:
        y = getattr(ops, name)(y) if name != "exp" else ops.exp(-jnp.abs(y))
    return (y * y).sum()


def _custom_calls_by_case_branch(module_text):
    """Walks the module: for each custom call, its target and the enclosing case branches
    as (id of the case op, region index) pairs, outermost first."""
    found = []

    def walk(op, path):
        for i, region in enumerate(op.regions):
            for block in region.blocks:
                for inner in block.operations:
                    here = path + ((id(op), i),) if op.name == "stablehlo.case" else path
                    if inner.name == "stablehlo.custom_call":
                        target = ir.StringAttr(inner.attributes["call_target_name"]).value
                        found.append((target, here))
                    walk(inner, here)

    with mlir.make_ir_context():
        module = ir.Module.parse(module_text)
        for op in module.body.operations:
            walk(op, ())
    return found


# ---------------------------------------------------------------- export golden check
def test_export_cpu_and_ascend_holds_cann_calls_only_in_the_ascend_branch():
    f = jax.jit(jax.value_and_grad(lambda x: _net(cannjax.ops, x)))
    exp = jax.export.export(
        f, platforms=["cpu", "ascend"], disabled_checks=ascend.disabled_checks()
    )(X)
    assert exp.platforms == ("cpu", "ascend")
    calls = [
        (t, path)
        for t, path in _custom_calls_by_case_branch(exp.mlir_module())
        if t.startswith("aclnn")
    ]
    targets = {t for t, _ in calls}
    # Forward kernels of all seven ops, backward kernels of the five CANN pairs.
    assert targets == set(ascend.config().targets.values())
    by_case = {}
    for _, path in calls:
        assert path, "a CANN call outside the platform conditional"
        case, branch = path[-1]
        by_case.setdefault(case, set()).add(branch)
    # In every platform conditional the CANN calls sit in one branch only (Ascend's);
    # the other branch is the XLA implementation.
    assert all(len(branches) == 1 for branches in by_case.values())
    # The CPU-only export has none, and the two-platform module runs on the CPU.
    cpu_only = jax.export.export(f, platforms=["cpu"])(X).mlir_module()
    assert "aclnn" not in cpu_only
    value, grad = exp.call(X)
    ref_v, ref_g = jax.value_and_grad(lambda x: _net(PLAIN, x))(X)
    close(value, ref_v, rtol=1e-5)
    close(grad, ref_g, rtol=1e-4)


def test_export_ascend_only_uses_the_cann_kernels_for_every_ascend_entry():
    # value_and_grad: under grad alone the forward's output is unused and removed.
    exp = jax.export.export(
        jax.jit(jax.value_and_grad(lambda x: cannjax.ops.gelu(x).sum())),
        platforms=["ascend"],
        disabled_checks=ascend.disabled_checks(),
    )(X)
    text = exp.mlir_module()
    assert text.count("custom_call @aclnnGeluV2") == 1
    assert text.count("custom_call @aclnnGeluBackwardV2") == 1
    assert "stablehlo.tanh" not in text  # no trace of the XLA gelu


def test_export_without_disabled_checks_names_the_target():
    with pytest.raises(ValueError, match="no compatibility guarantees(.|\n)*@aclnnGelu"):
        jax.export.export(
            jax.jit(jax.grad(lambda x: cannjax.ops.gelu(x).sum())), platforms=["ascend"]
        )(X)


def test_configure_renames_platform_and_targets():
    try:
        cfg = ascend.configure(platform="npu", targets={"gelu.forward": "MyGelu"})
        assert cfg.platform == "npu" and cfg.targets["gelu.forward"] == "MyGelu"
        assert "ascend" not in cannjax.core.kernel_table()["gelu"]
        assert backend.facts("npu").is_ascend and backend.facts("npu").overflow_mode == "saturation"
        exp = jax.export.export(
            jax.jit(lambda x: cannjax.ops.gelu(x)),
            platforms=["npu"],
            disabled_checks=ascend.disabled_checks(),
        )(X)
        assert "custom_call @MyGelu" in exp.mlir_module()
    finally:
        ascend.configure(platform="ascend", targets=dict(ascend.DEFAULT_TARGETS))
    assert ascend.config().targets == dict(ascend.DEFAULT_TARGETS)
    assert cannjax.core.kernel_table()["gelu"]["ascend"].rules() == ("forward", "backward")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"targets": {"gelu.sideways": "X"}}, "unknown target key 'gelu.sideways'"),
        ({"targets": {"gelu.forward": "not a name"}}, "must be an identifier"),
        ({"platform": "gpu"}, "use 'cuda' or 'rocm'"),
        ({"platform": "Ascend"}, "lower-case"),
    ],
)
def test_configure_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=f"cannjax.backend.ascend.configure: .*{match}"):
        ascend.configure(**kwargs)
    assert ascend.config().platform == "ascend"


def test_entries_install_only_where_ascend_is(monkeypatch):
    cannjax._src.core.kernels.generation("gelu")  # the import-time decision has run
    monkeypatch.delenv(ascend.KERNELS_ENV, raising=False)
    assert not ascend.should_install()  # this machine: cpu only
    assert not ascend.should_install({"cpu": None, "cuda": None})
    assert ascend.should_install({"cpu": None, "ascend": None})
    monkeypatch.setenv(ascend.KERNELS_ENV, "1")
    assert ascend.should_install({"cpu": None})
    monkeypatch.setenv(ascend.KERNELS_ENV, "0")
    assert not ascend.should_install({"ascend": None})
    monkeypatch.setenv(ascend.KERNELS_ENV, "yes")
    with pytest.raises(ValueError, match="CANNJAX_ASCEND_KERNELS must be 0, 1 or auto, got 'yes'"):
        ascend.should_install()
    ascend.uninstall()
    assert "gelu" not in cannjax.core.kernel_table() and not ascend.config().enabled
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: cannjax.ops.gelu(x).sum()))(X))
    assert "platform_index" not in jaxpr
    ascend.install()
    assert cannjax.core.kernel_table()["gelu"]["ascend"].rules() == ("forward", "backward")


# ---------------------------------------------------------------- padding policy
def test_matmul_padding_policy():
    assert backend.matmul_padding(60, 90, 120, platform="ascend") == (64, 96, 128)
    assert backend.matmul_padding(60, 90, 120, platform="cpu") == (60, 90, 120)
    assert backend.matmul_padding(64, 96, 128, platform="ascend") == (64, 96, 128)
    # Tiny dimensions stay (padding 8 -> 16 doubles the work); others are padded.
    assert backend.matmul_padding(8, 100, 8, platform="ascend") == (8, 112, 8)
    # Too much extra work: 17 -> 32 in every dimension is 6.7x.
    assert backend.matmul_padding(17, 17, 17, platform="ascend") == (17, 17, 17)
    assert backend.matmul_padding(17, 17, 17, platform="ascend", max_overhead=6) == (32, 32, 32)
    assert backend.matmul_padding(30, 30, 30, multiple=8) == (32, 32, 32)
    with pytest.raises(ValueError, match="matmul_padding: m must be a non-negative int, got -1"):
        backend.matmul_padding(-1, 2, 2)
    with pytest.raises(ValueError, match="multiple must be an int >= 1, got 0"):
        backend.matmul_padding(1, 2, 2, multiple=0)


def test_pad_for_platform_pads_and_is_exact():
    a = rand.normal(jax.random.key(0), (2, 60, 90))
    b = rand.normal(jax.random.key(1), (90, 120))
    mm = backend.pad_for_platform(jnp.matmul, platform="ascend")
    jaxpr = str(jax.make_jaxpr(mm)(a, b))
    assert "f32[2,64,96]" in jaxpr and "f32[96,128]" in jaxpr
    close(mm(a, b), a @ b, rtol=1e-5, atol=1e-4)
    ga, gb = jax.jit(jax.grad(lambda a, b: (mm(a, b) ** 2).sum(), argnums=(0, 1)))(a, b)
    ra, rb = jax.jit(jax.grad(lambda a, b: ((a @ b) ** 2).sum(), argnums=(0, 1)))(a, b)
    close(ga, ra, rtol=1e-4, atol=1e-3)
    close(gb, rb, rtol=1e-4, atol=1e-3)
    assert "pad" not in str(
        jax.make_jaxpr(backend.pad_for_platform(jnp.matmul, platform="cpu"))(a, b)
    )
    with pytest.raises(ValueError, match="expected a\\[..., M, K\\] and b\\[K, N\\]"):
        mm(a, b.T)


def test_padding_in_a_kernel_table_entry_of_a_user_matmul():
    # A user matmul op whose Ascend kernel pads: the Ascend branch multiplies padded
    # operands, the CPU branch the original ones.
    def forward(a, b):
        return a @ b, {"a": a, "b": b}

    mm = defop(
        "test_user_matmul",
        forward=forward,
        tangent=lambda r, ta, tb: ta @ r["b"] + r["a"] @ tb,
        backward=lambda r, g: (g @ r["b"].T, r["a"].T @ g),
    )
    padded = backend.pad_for_platform(jnp.matmul, platform="ascend")
    register_kernel(mm, "ascend", forward=lambda a, b: (padded(a, b), {"a": a, "b": b}))
    try:
        a, b = jnp.ones((60, 90)), jnp.ones((90, 120))
        exp = jax.export.export(jax.jit(mm), platforms=["cpu", "ascend"])(a, b)
        text = exp.mlir_module()
        assert "tensor<64x96xf32>" in text and "tensor<96x128xf32>" in text
        cpu_text = jax.export.export(jax.jit(mm), platforms=["cpu"])(a, b).mlir_module()
        assert "tensor<64x96xf32>" not in cpu_text
        close(exp.call(a, b), a @ b)
    finally:
        unregister_kernel(mm, "ascend")


# ---------------------------------------------------------------- numeric policies
def test_overflow_mode_and_matmul_multiple():
    # amp.half_dtype and amp.default_overflow_check read the same facts: tests/test_platform.py
    assert backend.facts("ascend").overflow_mode == "saturation"
    assert backend.facts("tpu").overflow_mode == "isfinite"
    assert backend.facts().overflow_mode == "isfinite"
    assert (
        backend.facts("ascend").matmul_multiple == 16 and backend.facts("cpu").matmul_multiple == 1
    )
    assert backend.facts("ascend").is_ascend and not backend.facts().is_ascend
    assert set(backend.OVERFLOW_MODES) == {
        backend.facts(p).overflow_mode for p in ("ascend", "cpu")
    }
    with pytest.raises(TypeError, match="cannjax.backend.facts: platform must be"):
        backend.facts(3)


# ---------------------------------------------------------------- plugin and info
def _dist_info(root: pathlib.Path, dist: str, entry_points: dict[str, str]) -> None:
    d = root / f"{dist.replace('-', '_')}-0.0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (d / "entry_points.txt").write_text(f"[jax_plugins]\n{lines}")


def test_info_reports_platform_kernels_and_a_dummy_plugin(tmp_path, monkeypatch):
    _dist_info(tmp_path, "dummy-jax-plugin", {"dummy_npu": "dummy_npu_plugin.module"})
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = backend.installed_plugins()
    assert (
        backend.PluginEntry(
            "dummy_npu", "dummy_npu_plugin.module", "dummy-jax-plugin", "entry point"
        )
        in plugins
    )
    report = backend.info()
    assert report.default_platform == "cpu"
    assert report.devices[0].startswith("cpu:0")
    assert len(report.devices) == len(jax.devices())
    assert "cpu" in report.backends
    assert report.kernels["gelu"]["ascend"] == (
        ("forward", "backward"),
        "CANN aclnnGeluV2 / aclnnGeluBackwardV2",
    )
    assert report.kernels["relu"]["ascend"][0] == ("forward",)
    assert set(report.kernels) >= set(ASCEND_OPS)
    assert report.ascend["half dtype"] == "float16"
    assert report.ascend["overflow mode"] == "saturation"
    assert report.ascend["available"] == "no"
    text = str(report)
    # Columns are padded to the longest plugin name (cannjax_ascend when installed).
    assert re.search(
        r"dummy_npu +dummy_npu_plugin\.module \(entry point, dummy-jax-plugin\)", text
    ), text
    for needle in (
        "default platform      cpu",
        "gelu @ ascend",
        "CANN aclnnGeluV2 / aclnnGeluBackwardV2",
        "CANNJAX_ASCEND_PJRT_LIBRARY",
    ):
        assert needle in text, needle
    html = report._repr_html_()
    assert "<table>" in html and "<td>gelu @ ascend</td>" in html
    monkeypatch.undo()
    assert not any(p.name == "dummy_npu" for p in backend.installed_plugins())


def test_plugin_does_nothing_without_a_library(monkeypatch, recwarn):
    monkeypatch.delenv(cannjax_ascend_plugin.LIBRARY_ENV, raising=False)
    st = cannjax_ascend_plugin.initialize()
    assert st.state == "not configured" and st.library_path is None
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_plugin_warns_on_a_missing_library(monkeypatch):
    monkeypatch.setenv(cannjax_ascend_plugin.LIBRARY_ENV, "/nonexistent/libpjrt_ascend.so")
    with pytest.warns(
        RuntimeWarning, match="does not name a file; the Ascend PJRT plugin is not registered"
    ):
        st = cannjax_ascend_plugin.initialize()
    assert st.state == "failed" and st.library_path == "/nonexistent/libpjrt_ascend.so"
    assert cannjax_ascend_plugin.status() == st


def test_plugin_warns_when_the_library_fails_to_load(monkeypatch, tmp_path):
    bad = tmp_path / "libnot_a_plugin.so"
    bad.write_text("not a shared library")
    monkeypatch.setenv(cannjax_ascend_plugin.LIBRARY_ENV, str(bad))
    with pytest.warns(RuntimeWarning, match="loading the Ascend PJRT plugin .* failed"):
        st = cannjax_ascend_plugin.initialize()
    assert st.state == "failed"
    assert jax.devices()[0].platform == "cpu"  # JAX is unharmed


def test_plugin_registers_a_configured_library(monkeypatch, tmp_path):
    from jax._src import xla_bridge

    lib = tmp_path / "libpjrt_npu.so"
    lib.write_bytes(b"\x7fELF")
    calls = []
    monkeypatch.setattr(xla_bridge, "register_plugin", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setenv(cannjax_ascend_plugin.LIBRARY_ENV, str(lib))
    monkeypatch.setenv(cannjax_ascend_plugin.PLATFORM_ENV, "npu")
    monkeypatch.setenv(cannjax_ascend_plugin.PRIORITY_ENV, "450")
    st = cannjax_ascend_plugin.initialize()
    assert calls == [(("npu",), {"priority": 450, "library_path": str(lib)})]
    assert st.state == "registered" and st.platform == "npu"
    monkeypatch.setenv(cannjax_ascend_plugin.PLATFORM_ENV, "N P U")
    with pytest.warns(RuntimeWarning, match="CANNJAX_ASCEND_PLATFORM must be a lower-case"):
        assert cannjax_ascend_plugin.initialize().state == "failed"
    assert len(calls) == 1


@pytest.mark.slow
def test_jax_discovers_the_entry_point_and_survives_a_bad_path(tmp_path):
    # A real JAX process, with the cannjax_ascend entry point installed as pyproject.toml
    # declares it and the library variable pointing nowhere: JAX starts on the CPU, our
    # initialize() ran (status "failed") and said why. cannjax imported first too.
    _dist_info(tmp_path, "cannjax", {"cannjax_ascend": "cannjax_ascend_plugin"})
    code = textwrap.dedent(
        """
        import sys
        if sys.argv[1] == "cannjax-first":
            import cannjax
        import jax, cannjax_ascend_plugin
        print(jax.devices()[0].platform, cannjax_ascend_plugin.status().state)
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    env[cannjax_ascend_plugin.LIBRARY_ENV] = "/nonexistent/libpjrt_ascend.so"
    env.pop("XLA_FLAGS", None)
    for order in ("jax-first", "cannjax-first"):
        run = subprocess.run(
            [sys.executable, "-c", code, order],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["cpu", "failed"], (run.stdout, run.stderr)
        assert "does not name a file" in run.stderr


def test_ascend_kernels_trace_under_shard_map():
    # FFI results carry the operands' varying mesh axes, so the Ascend branch type-checks
    # against the XLA one inside shard_map (lowered for cpu and ascend, run on cpu).
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    w = jnp.float32(0.5)

    def loss(x, w):
        return jax.lax.psum((cannjax.ops.gelu(x) * cannjax.ops.sigmoid(w * x)).sum(), "d")

    sm = jax.jit(jax.grad(jax.shard_map(loss, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())))
    x = jnp.linspace(-2.0, 2.0, 8, dtype=jnp.float32)
    exp = jax.export.export(
        sm, platforms=["cpu", "ascend"], disabled_checks=ascend.disabled_checks()
    )(x, w)
    assert "custom_call @aclnnGeluBackwardV2" in exp.mlir_module()

    def plain(x, w):
        return (jax.nn.gelu(x) * jax.nn.sigmoid(w * x)).sum()

    close(sm(x, w), jax.grad(plain)(x, w), rtol=1e-5)


def _report_with_markup():
    report = backend.info()
    return dataclasses.replace(
        report,
        ascend={**report.ascend, "plugin status": "failed: <lib> & co"},
        kernels={"gelu": {"ascend": (("forward", "backward"), "CANN <V2>")}},
    )


def test_backend_info_prints_one_aligned_table_per_section():
    text = str(_report_with_markup())
    assert text.startswith("cannjax backend\n")
    sections = text.split("\n\n")[1:]
    titles = [s.split("\n", 1)[0] for s in sections]
    assert titles == ["platform:", "PJRT plugins:", "kernel tables (others: XLA rules):", "ascend:"]
    tables = {}
    for s in sections:
        title, body = s.split("\n", 1)
        assert all(ln.startswith("  ") for ln in body.splitlines())
        tables[title] = table_cells(textwrap.dedent(body))
    assert tables["platform:"][0] == ["setting", "value"]
    assert ["default platform", "cpu"] in tables["platform:"]
    assert tables["kernel tables (others: XLA rules):"][1:] == [
        ["gelu @ ascend", "forward+backward: CANN <V2>"]
    ]
    assert ["plugin status", "failed: <lib> & co"] in tables["ascend:"]
    assert repr(_report_with_markup()) == text  # a REPL shows the tables, as print does


def test_backend_info_html_is_escaped_tables():
    page = _report_with_markup()._repr_html_()
    assert page.count("<table>") == 4 and page.count("</table>") == 4
    for caption in ("platform", "PJRT plugins", "kernel tables (others: XLA rules)", "ascend"):
        assert f"<table><caption>{caption}</caption>" in page
    assert "<td>forward+backward: CANN &lt;V2&gt;</td>" in page
    assert "<td>failed: &lt;lib&gt; &amp; co</td>" in page and "<lib>" not in page
