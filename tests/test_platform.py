"""One platform truth: every per-platform default follows the configured Ascend name.

The Ascend platform name comes from ``cannjax.backend.ascend.configure(platform=...)``
or ``$CANNJAX_ASCEND_PLATFORM``; amp's half dtype and overflow check, the backend's
overflow mode and matmul multiple, ``info()`` and the kernel table must all agree on it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
import cannjax_ascend_plugin
from cannjax import amp, backend
from cannjax._src.core import platform as platform_facts
from cannjax.backend import ascend

F16_MAX = 65504.0
# A float16 gradient clamped to float16's largest value, as saturation-mode hardware
# leaves an overflow: finite, so only the saturation check sees it.
SATURATED = {"w": jnp.array([1.0, -F16_MAX], jnp.float16), "step": jnp.array(3)}
FINE = {"w": jnp.array([1.0, -2.0], jnp.float16), "step": jnp.array(3)}
INF = {"w": jnp.array([1.0, jnp.inf], jnp.float32)}
NAN = [jnp.array([jnp.nan], jnp.bfloat16)]


@pytest.fixture
def env_name(monkeypatch):
    """The Ascend name follows ``$CANNJAX_ASCEND_PLATFORM`` (no configure() override)."""
    before = ascend.config()
    ascend.uninstall()
    monkeypatch.setattr(platform_facts, "_ascend_override", None)
    monkeypatch.delenv(cannjax_ascend_plugin.PLATFORM_ENV, raising=False)
    yield monkeypatch
    ascend.uninstall()
    monkeypatch.undo()
    if before.enabled:
        ascend.install()
    assert ascend.config() == before


@pytest.fixture(params=["environment", "configure"])
def myascend(request, env_name):
    """The Ascend platform named ``myascend``, by the variable or by configure()."""
    if request.param == "environment":
        env_name.setenv(cannjax_ascend_plugin.PLATFORM_ENV, "myascend")
    else:
        ascend.configure(platform="myascend")
    assert ascend.config().platform == "myascend"
    return "myascend"


def _expect(is_ascend):
    return {
        "half": np.dtype(jnp.float16 if is_ascend else jnp.bfloat16),
        "mode": "saturation" if is_ascend else "isfinite",
        "multiple": 16 if is_ascend else 1,
    }


@pytest.mark.parametrize("platform", ["myascend", "cpu", "ascend"])
def test_every_consumer_agrees_on_a_custom_ascend_name(myascend, platform):
    is_ascend = platform == myascend  # "ascend" is not special once the name is myascend
    want = _expect(is_ascend)
    facts = backend.facts(platform)
    assert (facts.is_ascend, facts.half_dtype, facts.overflow_mode, facts.matmul_multiple) == (
        is_ascend,
        want["half"],
        want["mode"],
        want["multiple"],
    )
    assert backend.facts(platform).is_ascend is is_ascend
    assert amp.half_dtype(platform) == want["half"]
    assert backend.facts(platform).overflow_mode == want["mode"]
    assert backend.facts(platform).matmul_multiple == want["multiple"]
    padded = (112, 208, 304) if is_ascend else (100, 200, 300)
    assert backend.matmul_padding(100, 200, 300, platform=platform) == padded
    policy = amp.get_policy("mixed", platform=platform)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        np.dtype(jnp.float32),
        want["half"],
        np.dtype(jnp.float32),
    )
    # The overflow check: 65504 in float16 is an overflow in saturation mode only.
    check = jax.jit(amp.default_overflow_check(platform))
    assert bool(check(SATURATED)) is not is_ascend
    assert (amp.default_overflow_check(platform) is amp.all_finite) is not is_ascend
    assert bool(check(FINE)) and not bool(check(INF)) and not bool(check(NAN))


def test_info_reports_the_custom_name_and_the_default_platform(myascend):
    report = backend.info()
    assert report.ascend["platform name"] == myascend
    assert report.ascend["half dtype"] == "float16"
    assert report.ascend["overflow mode"] == "saturation"
    assert report.ascend["matmul multiple"] == "16"
    assert report.ascend["available"] == "no"
    assert report.default_platform == "cpu"
    assert dict(report.defaults) == {
        "is ascend": "no",
        "half dtype": "bfloat16",
        "overflow mode": "isfinite",
        "matmul multiple": "1",
    }
    assert "myascend" in str(report) and "myascend" in report._repr_html_()


@pytest.mark.parametrize("how", ["environment", "configure"])
def test_the_default_platform_follows_the_name(env_name, how):
    # Naming cpu (this suite's default backend) as Ascend switches every default that
    # takes platform=None, amp.value_and_grad's overflow check included.
    if how == "environment":
        env_name.setenv(cannjax_ascend_plugin.PLATFORM_ENV, "cpu")
    else:
        ascend.configure(platform="cpu")
    assert backend.facts().is_ascend and amp.half_dtype() == jnp.float16
    assert backend.facts().overflow_mode == "saturation" and backend.facts().matmul_multiple == 16
    assert not bool(amp.default_overflow_check()(SATURATED))
    assert amp.get_policy("mixed").compute_dtype == jnp.float16
    assert backend.info().defaults["overflow mode"] == "saturation"

    def loss(w):  # d loss / d w16 is 65504 in float16: what a saturated overflow leaves
        return jnp.sum(w.astype(jnp.float16) * jnp.float16(F16_MAX)).astype(jnp.float32)

    w = jnp.ones(2, jnp.float32)
    r = jax.jit(amp.value_and_grad(loss, amp.NoOpLossScale()))(w)
    assert not bool(r.grads_finite)
    r = jax.jit(amp.value_and_grad(loss, amp.NoOpLossScale(), overflow_check=amp.all_finite))(w)
    assert bool(r.grads_finite)


def test_default_name_is_ascend_and_npu_is_not_special(env_name):
    assert ascend.config().platform == cannjax_ascend_plugin.DEFAULT_PLATFORM == "ascend"
    for platform, is_ascend in (("ascend", True), ("ASCEND", True), ("npu", False)):
        want = _expect(is_ascend)
        assert backend.facts(platform).is_ascend is is_ascend
        assert amp.half_dtype(platform) == want["half"]
        assert backend.facts(platform).overflow_mode == want["mode"]
        assert backend.facts(platform).matmul_multiple == want["multiple"]
        assert (amp.default_overflow_check(platform) is amp.all_finite) is not is_ascend
    # "npu" becomes Ascend when named so, and "ascend" stops being it.
    env_name.setenv(cannjax_ascend_plugin.PLATFORM_ENV, "npu")
    assert amp.half_dtype("npu") == jnp.float16 and amp.half_dtype("ascend") == jnp.bfloat16
    assert not bool(amp.default_overflow_check("npu")(SATURATED))
    # configure() overrides the variable until the override is cleared
    ascend.configure(platform="myascend")
    assert backend.facts("npu").overflow_mode == "isfinite"
    assert backend.facts("myascend").overflow_mode == "saturation"


def test_the_kernel_table_moves_with_the_name(env_name):
    env_name.setenv(cannjax_ascend_plugin.PLATFORM_ENV, "myascend")
    ascend.install()
    assert set(cannjax.core.kernel_table()["gelu"]) == {"myascend"}
    assert ascend.config().enabled
    env_name.setenv(cannjax_ascend_plugin.PLATFORM_ENV, "otherascend")
    assert not ascend.config().enabled  # the entries are still under the old name
    ascend.install()
    assert set(cannjax.core.kernel_table()["gelu"]) == {"otherascend"}
    ascend.configure(platform="thirdascend")
    assert set(cannjax.core.kernel_table()["gelu"]) == {"thirdascend"}
    assert ascend.config().enabled and backend.facts("thirdascend").is_ascend
    ascend.uninstall()
    assert "gelu" not in cannjax.core.kernel_table()


def test_bad_platform_arguments_name_the_function(env_name):
    for fn, call in (
        ("cannjax.amp.half_dtype", amp.half_dtype),
        ("cannjax.amp.default_overflow_check", amp.default_overflow_check),
        ("cannjax.backend.facts", backend.facts),
    ):
        for bad in (3, "", b"cpu"):
            with pytest.raises(TypeError, match=f"{fn}: platform must be a platform name"):
                call(bad)
    with pytest.raises(TypeError, match="cannjax.backend.matmul_padding: platform must be"):
        backend.matmul_padding(16, 16, 16, platform=3)
    # A bad variable is reported when the name is needed, by the variable's name.
    env_name.setenv(cannjax_ascend_plugin.PLATFORM_ENV, "N P U")
    with pytest.raises(ValueError, match="CANNJAX_ASCEND_PLATFORM must be a lower-case"):
        amp.half_dtype("cpu")
