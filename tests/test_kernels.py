"""Per-platform kernel tables: chosen at lowering time, differentiable, user-extensible.

The FFI path runs end to end with a CPU stand-in for the CANN gelu kernels, written in
C++ against ``jax.ffi.include_dir()`` and compiled with g++ at test time.
"""

import ctypes
import shutil
import subprocess
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.backend import ascend
from cannjax.core import defop, kernel_table, register_kernel, unregister_kernel

X = jnp.array([-3.0, -1.0, -0.25, 0.0, 0.5, 2.0, 4.0], jnp.float32)


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# A test operator y = 2 x. Kernels below compute *different* functions on purpose, so
# the result shows which implementation ran.
double = defop(
    "test_double",
    forward=lambda x: (2 * x, {}),
    tangent=lambda res, t: 2 * t,
    backward=lambda res, g: (2 * g,),
)


@pytest.fixture
def kernels_restored():
    """Removes the test_double kernels a test registers."""
    yield
    for platform in ("cpu", "tpu", "cuda"):
        unregister_kernel("test_double", platform)


# ---------------------------------------------------------------- registration
@pytest.mark.parametrize(
    "platform,match",
    [("gpu", "use 'cuda' or 'rocm'"), ("CPU", "lower-case"), (3, "lower-case"), ("", "lower")],
)
def test_register_kernel_rejects_bad_platforms(platform, match):
    with pytest.raises(ValueError, match=f"cannjax.core.register_kernel: .*{match}"):
        register_kernel("test_double", platform, forward=lambda x: (x, {}))


def test_register_kernel_rejects_bad_rules_and_duplicates(kernels_restored):
    with pytest.raises(ValueError, match="give forward=, backward= or both"):
        register_kernel("test_double", "cpu")
    with pytest.raises(TypeError, match="backward must be callable or None, got 3"):
        register_kernel("test_double", "cpu", backward=3)
    with pytest.raises(ValueError, match="op must be an operator name"):
        register_kernel("not a name", "cpu", forward=lambda x: (x, {}))
    register_kernel(double, "cpu", forward=lambda x: (3 * x, {}), source="first")
    with pytest.raises(ValueError, match="already has a 'cpu' kernel \\('first'\\)"):
        register_kernel("test_double", "cpu", forward=lambda x: (4 * x, {}))
    register_kernel("test_double", "cpu", forward=lambda x: (4 * x, {}), overwrite=True)
    close(double(1.0), 4.0)
    assert kernel_table()["test_double"]["cpu"].rules() == ("forward",)


def test_operators_without_kernels_have_no_dispatch_in_the_program():
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: cannjax.ops.sin(x).sum()))(X))
    assert "sin" in jaxpr
    assert "platform_index" not in jaxpr and "cond" not in jaxpr
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: double(x).sum()))(X))
    assert "platform_index" not in jaxpr


# ---------------------------------------------------------------- choice at lowering time
def test_kernel_of_the_lowering_platform_runs_others_are_dropped(kernels_restored):
    register_kernel(
        "test_double", "cpu", forward=lambda x: (3 * x, {}), backward=lambda r, g: (5 * g,)
    )
    tpu_call = jax.ffi.ffi_call("cannjax_test_tpu_only", jax.ShapeDtypeStruct((7,), jnp.float32))
    register_kernel("test_double", "tpu", forward=lambda x: (tpu_call(x), {}))

    def f(x):
        return double(x).sum()

    close(jax.jit(f)(X), 3 * X.sum())  # the cpu kernel ran, not the XLA rule (2 x)
    close(jax.jit(jax.grad(f))(X), 5 * jnp.ones(7))  # and the cpu backward
    # Differentiated or not, the forward stays inside the op's primitive until lowering
    # (the JVP binds it again, with its residuals), so no alternative is in the program;
    # lowering for cpu keeps only the cpu one.
    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(f))(X))
    assert "cannjax_op[residuals=True" in jaxpr and "cannjax_test_tpu_only" not in jaxpr
    assert "cannjax_test_tpu_only" not in jax.jit(jax.value_and_grad(f)).lower(X).as_text()
    assert "cannjax_test_tpu_only" not in jax.jit(f).lower(X).as_text()
    # A tpu lowering (export, never compiled here) holds the tpu kernel's custom call.
    exp = jax.export.export(
        jax.jit(f),
        platforms=["tpu"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("cannjax_test_tpu_only")],
    )(X)
    assert "custom_call @cannjax_test_tpu_only" in exp.mlir_module()


def test_table_changes_reach_eager_calls(kernels_restored):
    close(double(X), 2 * X)
    register_kernel("test_double", "cpu", forward=lambda x: (3 * x, {}))
    close(double(X), 3 * X)
    unregister_kernel("test_double", "cpu")
    close(double(X), 2 * X)
    assert "test_double" not in kernel_table()


def test_kernel_derivatives_are_those_of_the_xla_rule(kernels_restored):
    # jvp of the forward, hessian and jacfwd differentiate the kernel: they use the XLA
    # rule's derivative (2), while the values come from the kernel.
    register_kernel("test_double", "cpu", forward=lambda x: (2.0 * x, {}))
    y, t = jax.jvp(double, (X,), (jnp.ones(7),))
    close(y, 2 * X)
    close(t, 2 * jnp.ones(7))
    h = jax.hessian(lambda x: (cannjax.ops.sin(double(x))).sum())(X[:3])
    close(jnp.diag(h), -4 * jnp.sin(2 * X[:3]))
    close(jax.jacfwd(double)(X[:3]), 2 * jnp.eye(3))


def test_kernels_vmap(kernels_restored):
    register_kernel(
        "test_double", "cpu", forward=lambda x: (3 * x, {}), backward=lambda r, g: (5 * g,)
    )
    xs = jnp.stack([X, -X])
    close(jax.vmap(double)(xs), 3 * xs)
    close(jax.vmap(jax.grad(lambda x: double(x).sum()))(xs), 5 * jnp.ones_like(xs))


def test_a_kernel_with_the_wrong_structure_is_named(kernels_restored):
    register_kernel("test_double", "cpu", forward=lambda x: (3 * x, {"extra": x}))
    with pytest.raises(TypeError, match="forward kernel of operator 'test_double'"):
        jax.jit(jax.grad(lambda x: double(x).sum()))(X)


def test_the_ascend_table_leaves_cpu_programs_as_they_were():
    # gelu has an Ascend entry; the compiled CPU program is the one without it.
    def f(x):
        return jax.grad(lambda x: cannjax.ops.gelu(x).sum())(x)

    x = jnp.ones((64, 64), jnp.float32)
    was = ascend.config().enabled
    ascend.install()
    try:
        with_table = jax.jit(f).lower(x).compile()
        assert "platform_index" in str(jax.make_jaxpr(f)(x))
        ascend.uninstall()
        without = jax.jit(lambda x: f(x)).lower(x).compile()
    finally:
        ascend.install() if was else ascend.uninstall()
    assert "conditional" not in with_table.as_text()
    assert "aclnn" not in with_table.as_text()
    m1, m2 = with_table.memory_analysis(), without.memory_analysis()
    assert m1.temp_size_in_bytes == m2.temp_size_in_bytes
    assert m1.output_size_in_bytes == m2.output_size_in_bytes


# ---------------------------------------------------------------- FFI, end to end
_GELU_CC = textwrap.dedent(
    r"""
    // CPU stand-ins for CANN's aclnnGeluV2 / aclnnGeluBackwardV2 (float32).
    #include <cmath>
    #include <cstdint>
    #include "xla/ffi/api/ffi.h"
    namespace ffi = xla::ffi;

    static const double kSqrt2OverPi = 0.7978845608028654;
    static const double kInvSqrt2Pi = 0.3989422804014327;

    static double Tanh(double x) { return std::tanh(kSqrt2OverPi * (x + 0.044715 * x * x * x)); }

    static double Gelu(double x, bool tanh_form) {
      if (tanh_form) return 0.5 * x * (1.0 + Tanh(x));
      return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    }

    static double GeluGrad(double x, bool tanh_form) {
      if (tanh_form) {
        double t = Tanh(x);
        double du = kSqrt2OverPi * (1.0 + 3.0 * 0.044715 * x * x);
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
      }
      double cdf = 0.5 * (1.0 + std::erf(x / std::sqrt(2.0)));
      return cdf + x * std::exp(-0.5 * x * x) * kInvSqrt2Pi;
    }

    static ffi::Error Forward(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y,
                              int64_t approximate) {
      const float* in = x.typed_data();
      float* out = y->typed_data();
      for (size_t i = 0; i < x.element_count(); ++i) out[i] = (float)Gelu(in[i], approximate != 0);
      return ffi::Error::Success();
    }

    static ffi::Error Backward(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> x,
                               ffi::ResultBuffer<ffi::F32> dx, int64_t approximate) {
      const float* g = dy.typed_data();
      const float* in = x.typed_data();
      float* out = dx->typed_data();
      for (size_t i = 0; i < x.element_count(); ++i)
        out[i] = (float)(g[i] * GeluGrad(in[i], approximate != 0));
      return ffi::Error::Success();
    }

    XLA_FFI_DEFINE_HANDLER_SYMBOL(GeluForward, Forward,
        ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
            .Attr<int64_t>("approximate"));
    XLA_FFI_DEFINE_HANDLER_SYMBOL(GeluBackward, Backward,
        ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
            .Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("approximate"));
    """
)


@pytest.fixture(scope="module")
def gelu_standin(tmp_path_factory):
    """Builds the stand-in library and registers its targets for the cpu platform."""
    gxx = shutil.which("g++")
    assert gxx, "g++ is required to build the FFI stand-in kernel"
    d = tmp_path_factory.mktemp("ffi")
    (d / "gelu.cc").write_text(_GELU_CC)
    lib_path = d / "libgelu_standin.so"
    cmd = [gxx, "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}"]
    subprocess.run([*cmd, "-o", str(lib_path), str(d / "gelu.cc")], check=True)
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    names = {"gelu.forward": "cannjax_standin_gelu", "gelu.backward": "cannjax_standin_gelu_grad"}
    jax.ffi.register_ffi_target(
        names["gelu.forward"], jax.ffi.pycapsule(lib.GeluForward), platform="cpu"
    )
    jax.ffi.register_ffi_target(
        names["gelu.backward"], jax.ffi.pycapsule(lib.GeluBackward), platform="cpu"
    )
    return names


@pytest.fixture
def ascend_kernels_on_cpu(gelu_standin):
    """The Ascend kernel table, pointed at the cpu platform and the stand-in targets."""
    before = ascend.config()
    ascend.install()
    ascend.configure(platform="cpu", targets=gelu_standin)
    try:
        yield gelu_standin
    finally:
        ascend.configure(platform=before.platform, targets=dict(before.targets))
        if not before.enabled:
            ascend.uninstall()


@pytest.mark.parametrize("approximate", [True, False])
def test_ffi_kernels_run_end_to_end_through_the_ascend_table(ascend_kernels_on_cpu, approximate):
    names = ascend_kernels_on_cpu

    def loss(x):
        return (cannjax.ops.gelu(x, approximate=approximate) * jnp.cos(x)).sum()

    def reference(x):
        return (jax.nn.gelu(x, approximate=approximate) * jnp.cos(x)).sum()

    def everything(f, gelu):
        # One program (one compilation): value, gradient, vmap of the gradient (the FFI
        # call is batched with vmap_method="broadcast_all") and a second derivative
        # (which differentiates the XLA rule the kernel stands in for).
        def run(x):
            value, grad = jax.value_and_grad(f)(x)
            batched = jax.vmap(jax.grad(f))(jnp.stack([x, x / 2]))
            second = jax.grad(jax.grad(f))(x[4])
            return value, grad, batched, second, gelu(x, approximate=approximate)

        return jax.jit(run)

    ours = everything(loss, cannjax.ops.gelu)
    text = ours.lower(X).as_text()
    assert f"custom_call @{names['gelu.forward']}" in text
    assert f"custom_call @{names['gelu.backward']}" in text
    got, want = ours(X), everything(reference, jax.nn.gelu)(X)
    for a, b in zip(got, want):
        close(a, b, rtol=1e-4)
