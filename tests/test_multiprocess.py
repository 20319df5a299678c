"""Two processes on 127.0.0.1 (2 CPU devices each) train like one process on the batch."""

import importlib.util
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from cannjax import parallel

WORKER = pathlib.Path(__file__).with_name("_mp_worker.py")
_spec = importlib.util.spec_from_file_location("_mp_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
STEPS = 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, steps, extra=None):
    """Starts the two workers; returns [(proc, out_path)]."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONUNBUFFERED"] = "1"
    procs = []
    for pid in range(2):
        out = tmp_path / f"params{pid}.npz"
        cmd = [sys.executable, str(WORKER), str(port), str(pid), "2", str(steps), str(out)]
        cmd += (extra or {}).get(pid, [])
        procs.append(
            (
                subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
                ),
                out,
            )  # fmt: skip
        )
    return procs


def finish(procs, timeout):
    """Waits for every process (bounded), kills the rest; returns [(rc, output, secs)]."""
    results, t0 = [], time.monotonic()
    try:
        for p, _ in procs:
            left = max(1.0, timeout - (time.monotonic() - t0))
            try:
                out, _ = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += "\n<killed by the test: timeout>"
            results.append((p.returncode, out, time.monotonic() - t0))
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def reference_params(steps):
    """One process, one device, the whole batch."""
    opt = optax.adam(1e-2)
    params = worker.init_params()
    state = opt.init(params)

    @jax.jit
    def step(p, s, batch):
        g = jax.grad(worker.loss_fn)(p, batch)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    for i in range(steps):
        params, state = step(params, state, worker.global_batch(i))
    return params


def test_two_processes_train_like_one(tmp_path):
    results = finish(launch(tmp_path, STEPS), timeout=60)
    for rc, out, _ in results:
        assert rc == 0, out[-3000:]
    got = [np.load(tmp_path / f"params{i}.npz") for i in range(2)]
    # The two processes hold bit-identical replicas.
    for k in got[0].files:
        np.testing.assert_array_equal(got[0][k], got[1][k])
    # Same as one process training on the whole batch (one device: rounding apart).
    want = jax.tree.leaves(reference_params(STEPS))
    assert len(want) == len(got[0].files)
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[0][f"arr_{i}"], w, rtol=1e-5, atol=1e-6)
    # And the same data-parallel step on one process with 4 devices.
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    opt = optax.adam(1e-2)
    step = parallel.data_parallel(worker.loss_fn, opt, mesh=mesh, bucket_bytes=1024)
    p = worker.init_params()
    s = opt.init(p)
    for i in range(STEPS):
        res = step(p, s, worker.global_batch(i))
        p, s = res.params, res.opt_state
    for i, w in enumerate(jax.tree.leaves(p)):
        np.testing.assert_allclose(got[0][f"arr_{i}"], w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dies", [1, 0], ids=["worker_dies", "coordinator_dies"])
def test_a_dead_process_fails_the_other_in_bounded_time(tmp_path, dies):
    # The survivor would train 10_000 steps; it must instead be stopped by the
    # coordination service soon after its peer's heartbeats stop (heartbeat 3 s).
    procs = launch(tmp_path, 10_000, extra={dies: ["--die-after", "2"]})
    results = finish(procs, timeout=45)
    rc_dead, out_dead, _ = results[dies]
    rc_alive, out_alive, t_alive = results[1 - dies]
    assert rc_dead == 3 and "dies now" in out_dead, out_dead[-2000:]
    assert "<killed by the test" not in out_alive, out_alive[-2000:]
    assert rc_alive != 0
    assert "process 1 step 9999" not in out_alive
    assert any(s in out_alive for s in ("another task died", "heartbeat", "unhealthy")), out_alive[
        -3000:
    ]
    assert t_alive < 45


def test_coordinator_alone_gives_up_after_init_timeout(tmp_path):
    # Only process 0 starts; its peer never connects. JAX aborts it after init_timeout_s.
    port = free_port()
    cmd = [sys.executable, str(WORKER), str(port), "0", "2", "1", str(tmp_path / "p.npz"),
           "--init-timeout", "2"]  # fmt: skip
    t0 = time.monotonic()
    (rc, out, _), = finish([(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True), None)], timeout=40)  # fmt: skip
    assert "<killed by the test" not in out, out[-2000:]
    assert rc != 0 and "DEADLINE_EXCEEDED" in out, out[-2000:]
    assert time.monotonic() - t0 < 40


def test_import_does_not_start_a_backend():
    # cannjax.parallel.initialize must be callable after `import cannjax`.
    code = "import cannjax, jax._src.xla_bridge as xb; print(bool(xb._backends))"
    root = pathlib.Path(__file__).parents[1]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=root)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# ------------------------------------------------------- FSDP and tensor parallel
SHARDED = pathlib.Path(__file__).with_name("_mp_sharded_worker.py")
_sspec = importlib.util.spec_from_file_location("_mp_sharded_worker", SHARDED)
sharded_worker = importlib.util.module_from_spec(_sspec)
_sspec.loader.exec_module(sharded_worker)


@pytest.mark.slow
@pytest.mark.parametrize(
    "modes",
    # Both with `make test-extended` (CI): 30 s and more each on 2 cores. make test keeps
    # the sharded data_parallel step in one process (tests/test_sharding.py).
    [
        pytest.param(["both", "dp-both"], marks=pytest.mark.extended),
        pytest.param(["fsdp", "tp", "dp-fsdp-reshard"], marks=pytest.mark.extended),
    ],
    ids=["fsdp+tp", "fsdp-and-tp"],
)
def test_two_processes_sharded_give_the_one_process_gradients(tmp_path, modes):
    # 2 processes x 4 devices, a 4x2 data x model mesh spanning both: the sharded
    # gradient of the GPT (jax.jit, and data_parallel for "dp-*") equals the one
    # computed here on one device.
    from cannjax.models import gpt_loss, init_gpt

    port, out = free_port(), tmp_path / "grads.npz"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    procs = [
        (subprocess.Popen(
            [sys.executable, str(SHARDED), str(port), str(pid), "2", str(out), *modes],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True), out)
        for pid in range(2)
    ]  # fmt: skip
    for rc, text, _ in finish(procs, timeout=240):
        assert rc == 0, text[-3000:]
    got = np.load(out)
    cfg = sharded_worker.config()
    tokens = sharded_worker.global_tokens()
    loss, grads = jax.jit(jax.value_and_grad(lambda p, t: gpt_loss(p, t, t, cfg)))(
        init_gpt(jax.random.key(0), cfg), tokens
    )
    for mode in modes:
        np.testing.assert_allclose(got[f"{mode}/loss"].ravel()[0], loss, rtol=1e-6)
        for i, g in enumerate(jax.tree.leaves(grads)):
            np.testing.assert_allclose(got[f"{mode}/{i}"], g, rtol=1e-5, atol=1e-6)
