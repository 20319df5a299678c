"""One process of the multi-process data-parallel test (run by tests/test_multiprocess.py).

Usage: python tests/_mp_worker.py PORT PROCESS_ID NUM_PROCESSES STEPS OUT [--die-after K]
       [--init-timeout SECONDS]
Each process has 2 CPU devices, takes its share of the global batch, trains STEPS steps
with cannjax.parallel.data_parallel and writes the final parameters to OUT (.npz).
"""

import os
import sys

import numpy as np

GLOBAL_BATCH = 16
SIZES = (6, 16, 16, 4)


def init_params():
    """Deterministic MLP parameters (numpy: no JAX backend needed)."""
    rng = np.random.RandomState(0)
    return [
        {
            "w": (rng.randn(a, b) / np.sqrt(a)).astype(np.float32),
            "b": (0.1 * rng.randn(b)).astype(np.float32),
        }  # fmt: skip
        for a, b in zip(SIZES[:-1], SIZES[1:])
    ]


def global_batch(step):
    """The global batch of step ``step``: the same on every process."""
    rng = np.random.RandomState(100 + step)
    x = rng.randn(GLOBAL_BATCH, SIZES[0]).astype(np.float32)
    y = rng.randn(GLOBAL_BATCH, SIZES[-1]).astype(np.float32)
    return x, y


def loss_fn(params, batch):
    """Mean squared error of a tanh MLP."""
    import jax.numpy as jnp

    x, y = batch
    h = x
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"][None])
    out = h @ params[-1]["w"] + params[-1]["b"][None]
    return jnp.mean((out - y) ** 2)


def main(argv):
    port, pid, nproc, steps, out = argv[:5]
    pid, nproc, steps = int(pid), int(nproc), int(steps)
    die_after = int(argv[argv.index("--die-after") + 1]) if "--die-after" in argv else None
    init_timeout = int(argv[argv.index("--init-timeout") + 1]) if "--init-timeout" in argv else 30
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import optax

    from cannjax import parallel

    parallel.initialize(
        f"127.0.0.1:{port}", nproc, pid, local_device_count=2, init_timeout_s=init_timeout,
        heartbeat_timeout_s=3,
    )  # fmt: skip
    import jax

    assert jax.process_count() == nproc and len(jax.devices()) == 2 * nproc
    mesh = parallel.data_mesh()
    opt = optax.adam(1e-2)
    step = parallel.data_parallel(loss_fn, opt, mesh=mesh, bucket_bytes=1024)
    params = parallel.replicate(init_params(), mesh)
    state = parallel.replicate(opt.init(init_params()), mesh)
    share = GLOBAL_BATCH // nproc
    for i in range(steps):
        x, y = global_batch(i)
        mine = slice(pid * share, (pid + 1) * share)
        batch = parallel.shard_batch((x[mine], y[mine]), mesh)
        res = step(params, state, batch)
        params, state = res.params, res.opt_state
        jax.block_until_ready(params)
        print(f"process {pid} step {i} loss {float(res.metrics['loss'].addressable_data(0))}",
              flush=True)  # fmt: skip
        if die_after is not None and i + 1 == die_after:
            print(f"process {pid} dies now", flush=True)
            os._exit(3)
    leaves = [np.asarray(p.addressable_data(0)) for p in jax.tree.leaves(params)]
    np.savez(out, *leaves)
    print(f"process {pid} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
