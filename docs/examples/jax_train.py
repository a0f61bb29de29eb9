"""A JAX training loop: sharded parameters, async checkpoints, resume, and restoring onto another mesh.

Run ``python docs/examples/jax_train.py ROOT`` (one process, 8 CPU devices).
It trains a small MLP to step 12 with its parameters sharded over a 4-device
mesh, saving every 3 steps with ``JaxCheckpointManager`` (async: ``save``
starts the device->host copies, stages them and returns while the next step
runs). ``--crash-at 8`` dies at step 8; the next run resumes from step 6.
At the end the latest step is restored onto a 2-device mesh.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reshard.store.manager import JaxCheckpointManager

LAST, EVERY = 12, 3


def shardings(mesh: Mesh) -> dict:
    return {"w1": NamedSharding(mesh, P(None, "x")), "b1": NamedSharding(mesh, P("x")),
            "w2": NamedSharding(mesh, P("x", None)), "b2": NamedSharding(mesh, P())}


def init(mesh: Mesh) -> dict:
    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((16, 32)) * 0.1, "b1": np.zeros(32), "w2": rng.standard_normal((32, 4)) * 0.1,
              "b2": np.zeros(4)}
    return {k: jax.device_put(v.astype(np.float32), shardings(mesh)[k]) for k, v in params.items()}


def batch(step: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(step)
    return jnp.asarray(rng.standard_normal((8, 16)), jnp.float32), jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


@jax.jit
def train_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads), loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--crash-at", type=int, default=None)
    args = p.parse_args()
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    params = init(mesh)
    mgr = JaxCheckpointManager(args.root, {"params": params, "step": 0}, max_to_keep=2)
    start = 0
    if mgr.latest_step() is not None:  # resume
        restored = mgr.restore({"params": params, "step": None})
        params, start = restored["params"], restored["step"]
        print(f"resumed from step {start}")
    for step in range(start + 1, LAST + 1):
        params, loss = train_step(params, *batch(step))
        if step == args.crash_at:
            os._exit(1)  # a crash: no wait, no close
        if step % EVERY == 0:
            mgr.save(step, {"params": params, "step": step}, metrics={"loss": float(loss)})
    mgr.close()  # waits for the last save to be written and committed
    small = Mesh(np.array(jax.devices()[:2]), ("x",))  # another mesh: each device reads only its part
    other = mgr.restore({"params": shardings(small), "step": None})
    assert all(np.array_equal(np.asarray(other["params"][k]), np.asarray(params[k])) for k in params)
    print(f"steps kept: {mgr.steps()}, final loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
