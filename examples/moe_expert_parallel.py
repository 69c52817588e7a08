"""A mixture-of-experts GPT trained with expert parallelism (x data parallelism).

    python examples/moe_expert_parallel.py --steps 10
    python examples/moe_expert_parallel.py --experts 16 --capacity-factor 1.0
    python examples/moe_expert_parallel.py --dropless                 # no capacity

Every block's MLP is a ``parallax.nn.MoE`` (top-2 routing over SwiGLU experts, GShard's
capacity). ``px.ExpertParallel("expert")`` splits the experts over the ``expert`` mesh axis
(and the batch over it too); ``px.DataParallel("data")`` replicates them over ``data``. The
script prints the all-to-alls of the compiled step (two per MoE layer forward, two
backward), then trains, printing the loss with the router's auxiliary losses, the dropped
fraction and the tokens per expert, and checks the loss curve against one device. On a GPU
or TPU it computes in bf16 with fp32 master parameters and optimizer (``px.MixedPrecision``;
the router stays fp32), on CPU in fp32 (``--precision`` chooses); the comparison's tolerance
is 1e-4 in fp32, 3e-2 in bf16.

``--dropless`` routes without a capacity (every token reaches its two experts, as Mixtral);
the exchange then sends the routed tokens only: ragged all-to-alls on a GPU or TPU, rounds
of fixed-size all-to-alls sized by the busiest expert on CPU (``--dropless-exchange``
forces one; docs/moe.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--dropless", action="store_true",
                        help="no capacity: every token reaches its experts")
    parser.add_argument("--dropless-exchange", choices=("auto", "ragged", "rounds"),
                        default="auto", help="ragged all-to-alls (GPU/TPU) or rounds (any)")
    from parallax.precision import add_arguments as add_precision_argument

    args = add_precision_argument(parser).parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px
    from parallax.analysis import hlo
    from parallax.cli.demo import batches, demo_tokens
    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU

    moe = px.models.MoEConfig(num_experts=args.experts, top_k=2,
                              capacity_factor=None if args.dropless else args.capacity_factor)
    config = px.models.GPTConfig.tiny(num_layers=2, mlp_dim=128, max_seq_len=32, moe=moe,
                                      dtype=compute)
    expert = 4 if jax.device_count() % 4 == 0 else 1
    mesh = px.make_mesh(data=jax.device_count() // expert, expert=expert)
    ep = px.ExpertParallel("expert", dropless_exchange=args.dropless_exchange)
    strategy = px.compose(px.DataParallel("data"), ep,
                          *([px.MixedPrecision(compute=compute)] if compute != "float32" else []))
    data = list(batches(demo_tokens(), 16, config.max_seq_len, args.steps))

    def make_state(config=config):
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)),
                                    optax.adam(3e-3))

    @px.train_step(mesh, strategy)
    def step(state, batch):
        (loss, stats), grads = px.value_and_grad(px.models.moe_next_token_loss,
                                                 has_aux=True)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss, **stats}

    state = px.init(make_state, mesh, strategy)
    compiled = step.compile(state, data[0])  # the loop runs it
    found = hlo.collectives(compiled, mesh)
    slots = (f"dropless ({ep.experts.dropless_exchange(mesh)} exchange)" if moe.dropless
             else f"capacity {moe.capacity(32)} per sequence")
    print(f"mesh {dict(mesh.shape)}, {moe.num_experts} experts "
          f"({moe.num_experts // expert} per device), {slots}")
    print(hlo.table([c for c in found if c.kind == "all-to-all"]))
    ragged = compiled.as_text().count("ragged-all-to-all(")
    if ragged:  # parallax.analysis.hlo does not read these: their sizes follow the routing
        print(f"ragged all-to-alls in the program: {ragged}")

    losses = []
    for i, batch in enumerate(data):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        load = np.asarray(m["expert_load"]).mean(0) * moe.num_experts
        print(f"step {i + 1}: loss {losses[-1]:.4f} (cross-entropy {float(m['cross_entropy']):.4f}"
              f", balance {float(m['load_balance_loss']):.3f}, z {float(m['router_z_loss']):.3f})"
              f", dropped {float(m['dropped_fraction']):.1%}, load/even "
              f"{' '.join(f'{x:.2f}' for x in load)}")

    fp32 = dataclasses.replace(config, dtype=jnp.float32)  # the reference computes in fp32
    reference = px.testing.train(lambda: make_state(fp32), lambda mdl, b:
                                 px.models.moe_next_token_loss(mdl, b)[0], data)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference.losses))
    tolerance = 1e-4 if compute == "float32" else 3e-2
    print(f"loss curve vs one device (fp32): largest relative difference {worst:.1e} "
          f"(tolerance {tolerance:.0e}, {compute})")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
