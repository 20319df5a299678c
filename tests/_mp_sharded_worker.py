"""One process of the multi-process FSDP / tensor-parallel test (tests/test_multiprocess.py).

Usage: python tests/_mp_sharded_worker.py PORT PROCESS_ID NUM_PROCESSES OUT MODE [MODE ...]
Each process has 4 CPU devices; the 8 global devices form a 4x2 ``data x model`` mesh.
For each MODE (``fsdp``, ``tp``, ``both``) the tiny GPT of cannjax.models is sharded by
cannjax.parallel.param_shardings, its gradient taken on the global batch, gathered to
every process, and written by process 0 to OUT (.npz, ``MODE/leaf-index`` keys).
``dp-both`` takes the same gradient through ``cannjax.parallel.data_parallel(...,
param_shardings=...)`` (FSDP + tensor parallel), ``dp-fsdp-reshard`` the same with FSDP
alone and ``reshard_after_forward=True`` (layer by layer): an optimizer whose state is the
averaged gradient (``optax.trace(decay=0)``) hands it out.
"""

import os
import sys

import numpy as np

MODES = {"fsdp": {"fsdp": "data"}, "tp": {"tensor": "model"},
         "both": {"fsdp": "data", "tensor": "model"},
         "dp-both": {"fsdp": "data", "tensor": "model"},
         "dp-fsdp-reshard": {"fsdp": "data"}}  # fmt: skip


def config():
    from cannjax.models import GPTConfig

    return GPTConfig(vocab=64, width=32, heads=4, layers=2, seq_len=16)


def global_tokens():
    """The global batch: the same on every process."""
    return np.random.RandomState(7).randint(0, config().vocab, (8, config().seq_len))


def main(argv):
    port, pid, nproc, out, *modes = argv
    pid, nproc = int(pid), int(nproc)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cannjax import parallel

    parallel.initialize(
        f"127.0.0.1:{port}", nproc, pid, local_device_count=4, init_timeout_s=60,
        heartbeat_timeout_s=5,
    )  # fmt: skip
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cannjax.models import gpt_loss, init_gpt

    assert jax.process_count() == nproc and len(jax.devices()) == 8
    cfg = config()
    host = jax.tree.map(np.asarray, init_gpt(jax.random.key(0), cfg))
    tokens = global_tokens()
    mesh = parallel.model_mesh(4, 2)
    result = {}
    for mode in modes:
        shardings = parallel.param_shardings(host, mesh, **MODES[mode])

        def place(x, s):
            return jax.make_array_from_callback(x.shape, s, lambda idx, x=x: x[idx])

        params = jax.tree.map(place, host, shardings)
        rows = NamedSharding(mesh, P("data"))
        batch = place(tokens, rows)
        if mode.startswith("dp-"):
            import optax

            opt = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))
            step = parallel.data_parallel(
                lambda p, t: gpt_loss(p, t, t, cfg), opt, param_shardings=shardings,
                reshard_after_forward=mode.endswith("-reshard"),
            )  # fmt: skip
            done = step(params, jax.jit(opt.init)(params), batch)
            loss, grads = done.metrics["loss"], done.opt_state[0].trace
        else:
            step = jax.jit(
                jax.value_and_grad(lambda p, t: gpt_loss(p, t, t, cfg)),
                in_shardings=(shardings, rows),
            )
            loss, grads = step(params, batch)
        full = multihost_utils.process_allgather(grads, tiled=True)
        for i, g in enumerate(jax.tree.leaves(full)):
            result[f"{mode}/{i}"] = np.asarray(g)
        result[f"{mode}/loss"] = np.asarray(loss.addressable_data(0))  # replicated
        print(f"process {pid} {mode} loss {float(result[f'{mode}/loss'].ravel()[0])}", flush=True)
    if pid == 0:
        np.savez(out, **result)
    print(f"process {pid} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
