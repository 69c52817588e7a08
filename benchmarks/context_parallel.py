"""Context parallelism: attention memory per device and messages vs sequence length (CPU).

For each sequence length, one causal attention layer's forward and backward (GPT tiny's
heads: H = 4, K = 16, batch 1, fp32) is compiled, never run, on 1, 2 and 4 simulated CPU
devices of a ``context`` axis with ``px.ContextParallel`` (ring and all_gather). Printed:
XLA's temp bytes per device (``memory_analysis``), its ratio to one device, and the
collective-permute / all-gather counts and bytes of the compiled program next to the
formula (ring, per layer: ``3n - 2`` permutes of one device's K and V; all-gather: 2 of
all K and V). Here forward and backward are one unscanned computation, so XLA's CSE reuses
the forward's K/V shifts (and the all-gather) in the backward: the program holds ``2n - 1``
permutes (1 all-gather), keeping the received blocks alive instead. Inside the GPT's
scanned layers the backward is its own loop and the full formula holds (the tests check it).

Run: ``python benchmarks/context_parallel.py [--lengths 1024 2048 ...]``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import parallax as px  # noqa: E402
from parallax import context  # noqa: E402
from parallax.analysis import hlo  # noqa: E402
from parallax.attention import dot_product_attention  # noqa: E402

H, K = 4, 16


def program(length: int, n: int, method: str):
    """The compiled forward + backward of one attention layer on ``n`` context devices."""
    mesh = px.make_mesh(devices=jax.devices()[:n], context=n)
    strategy = px.ContextParallel(method=method)
    spec = jax.sharding.NamedSharding(mesh, jax.P(None, "context"))
    x = jax.ShapeDtypeStruct((1, length, H, K), jnp.float32, sharding=spec)

    def loss(q, k, v):
        with context.activate(context.StepContext(mesh, strategy)):
            return jnp.sum(dot_product_attention(q, k, v, causal=True) ** 2)

    with jax.set_mesh(mesh):
        return mesh, jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()


def row(length: int, n: int, method: str, base: int | None):
    mesh, compiled = program(length, n, method)
    temp = hlo.memory(compiled).temp_bytes
    found = [c for c in hlo.collectives(compiled, mesh) if c.axes == ("context",)]
    kind = "collective-permute" if method == "ring" else "all-gather"
    kv = 2 * length // n * H * K * 4
    formula = (3 * n - 2, (3 * n - 2) * kv) if method == "ring" else (2, 2 * n * kv)
    ratio = f"{temp / base:6.3f}" if base else "   -  "
    return (f"{length:>7} {method:>10} {n:>3} {temp / 2**20:>10.2f} {ratio} "
            f"{hlo.count(found, kind):>6} {hlo.total_bytes(found, kind):>12,} "
            f"{formula[0]:>6} {formula[1]:>12,}"), temp


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    args = parser.parse_args(argv)
    print(f"{'T':>7} {'method':>10} {'CP':>3} {'temp MiB':>10} {'vs 1':>6} {'msgs':>6} "
          f"{'bytes':>12} {'ring':>6} {'formula':>12}")
    for length in args.lengths:
        _, base = row(length, 1, "ring", None)
        print(f"{length:>7} {'one device':>10} {1:>3} {base / 2**20:>10.2f}")
        for method in ("ring", "all_gather"):
            for n in (2, 4):
                print(row(length, n, method, base)[0])


if __name__ == "__main__":
    main()
