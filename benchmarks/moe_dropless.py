"""Dropless MoE under expert parallelism: padded to ``C = S`` vs in rounds vs ragged, from the
compiled programs, with step time alternating (run by ``benchmarks/moe.py``; importable alone).

One dropless ``px.nn.MoE`` layer between stock Flax layers (``nnx.Linear``, ``LayerNorm``),
``data=2 x expert=4``, top-2. The padded program is the capacity path with
``capacity_factor = E / k`` (``C = S``: nothing can drop, the dropless padding); the rounds
program is ``capacity_factor=None`` (``parallax.nn.moe_dropless``). Per device and step:

- all-to-all bytes: the padded program's from its HLO; the rounds program's from its HLO's
  per-round all-to-alls times the rounds that ran (the busiest expert's, computed from the
  same routing on the host: ``rounds_needed``), against ``4 x rounds x E c D x 4`` bytes,
  ``c = ceil(N k / E)``;
- matmul FLOPs of the whole step (``parallax.analysis.program.matmul_flops``, the rounds'
  conditional weighted by the rounds that ran);
- step time: the two programs alternate, ``--repeats`` times, median ratio padded / rounds;
- the ragged exchange (``dropless_exchange="ragged"``, ``jax.lax.ragged_all_to_all``), which
  XLA:CPU cannot compile: its step is lowered for CUDA and its four ragged all-to-alls'
  shapes read from the text (``[N k, D]`` routed rows, ``[n N min(k, E / n), D]`` receive
  buffer); the bytes that run depend on the routing, so they are the formula
  ``(2 N k + 2 R) D x 4`` with ``N k D`` from the lowered shape and ``R`` (the rows the
  busiest device's experts receive) from the same routing on the host. No time: it cannot
  run here.
"""

from __future__ import annotations

import re
import statistics
import time
import warnings


def compare(experts_list=(4, 8, 16), repeats=5, rows=16, seq=32, embed=64, mlp=128):
    """Prints the table; returns its rows as dicts."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px
    from parallax.analysis import hlo, program
    from parallax.nn.moe import aux_loss
    from parallax.nn.moe_dropless import most_rounds, round_slots, rounds_needed
    from parallax.nn.moe_routing import route

    mesh = px.make_mesh(data=2, expert=4)
    strategy = px.compose(px.DataParallel("data"), px.ExpertParallel("expert"))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((rows, seq, 8)).astype(np.float32),
             "y": rng.standard_normal((rows, seq, 8)).astype(np.float32)}
    tokens = rows // mesh.size * seq  # N per device

    class Net(nnx.Module):
        def __init__(self, config):
            rngs = nnx.Rngs(0)
            self.inp, self.norm = nnx.Linear(8, embed, rngs=rngs), nnx.LayerNorm(embed, rngs=rngs)
            self.moe = px.nn.MoE(embed, config, rngs=rngs)
            self.out = nnx.Linear(embed, 8, rngs=rngs)

        def hidden(self, x):
            return self.norm(self.inp(x))

        def __call__(self, x):
            h = self.hidden(x)
            y, stats = self.moe(h)
            return self.out(h + y), stats

    def build(config, strategy=strategy):
        def loss(model, batch):
            pred, stats = model(batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2) + aux_loss(stats, config), stats

        state = px.init(lambda: px.TrainState.create(Net(config), optax.adam(1e-3)), mesh,
                        strategy)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            (_, stats), grads = px.value_and_grad(loss, has_aux=True)(state.model, batch)
            return state.apply_gradients(grads), stats

        return state, step

    def routed(experts):  # the layer's own routing on the host: [devices, N, k]
        model = Net(px.nn.MoEConfig(num_experts=experts, top_k=2, capacity_factor=None,
                                    mlp_dim=mlp))
        logits = jnp.einsum("gsd,de->gse", model.hidden(batch["x"]), model.moe.router[...])
        return np.asarray(route(logits, 2, "softmax").experts).reshape(mesh.size, tokens, 2)

    def rounds_ran(experts):
        return max(int(rounds_needed(jnp.asarray(d), experts)) for d in routed(experts))

    def ragged_received(experts):
        """The most rows one device's experts receive (R), over the data shards' groups."""
        n, local = mesh.shape["expert"], experts // mesh.shape["expert"]
        chosen = routed(experts).reshape(mesh.shape["data"], n, -1) // local  # device of each
        return max(int(np.sum(group == j)) for group in chosen for j in range(n))

    def ragged_lowered(experts):
        """The four ragged all-to-alls' (operand, output) shapes in the CUDA-lowered step."""
        ep = px.ExpertParallel("expert", dropless_exchange="ragged")
        strategy_ragged = px.compose(px.DataParallel("data"), ep)
        config = px.nn.MoEConfig(num_experts=experts, top_k=2, mlp_dim=mlp,
                                 capacity_factor=None)
        state, step = build(config, strategy_ragged)
        with warnings.catch_warnings():  # "XLA:CPU cannot run it": known, lowered for CUDA
            warnings.simplefilter("ignore", UserWarning)
            text = step.lower(state, batch, platforms=("cuda",)).as_text()
        found = [re.search(r"\} : \(tensor<(\d+)x(\d+)xf32>, tensor<(\d+)x\d+xf32>,", line)
                 for line in text.splitlines() if "custom_call @ragged_all_to_all" in line]
        return [tuple(int(v) for v in m.groups()) for m in found]

    def timed(step, state, n=3):
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(n):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        return state, (time.perf_counter() - start) / n * 1e3

    print("\ndropless, data=2 x expert=4, one MoE layer, top-2, "
          f"{rows} x {seq} tokens, D={embed}, F={mlp} (per device and step)")
    print(f"{'E':>3} {'rounds':>7} {'a2a bytes padded':>17} {'rounds':>9} {'formula':>9} "
          f"{'ragged':>9} {'MFLOP padded':>13} {'rounds':>8} {'ms ratio padded/rounds':>23}")
    table = []
    for experts in experts_list:
        ran, most = rounds_ran(experts), most_rounds(tokens, 2, experts)
        c = round_slots(tokens, 2, experts)

        def shares(op_name, branches, ran=ran, most=most):
            if "dropless_round" not in op_name or branches != 2:
                return None
            return [1 - ran / most, ran / most]

        padded = build(px.nn.MoEConfig(num_experts=experts, top_k=2, mlp_dim=mlp,
                                       capacity_factor=experts / 2))
        rounds = build(px.nn.MoEConfig(num_experts=experts, top_k=2, mlp_dim=mlp,
                                       capacity_factor=None))
        compiled = [step.lower(state, batch).compile() for state, step in (padded, rounds)]
        bytes_padded = hlo.total_bytes(hlo.collectives(compiled[0], mesh), "all-to-all")
        totals = program.collective_totals(compiled[1], mesh, shares)
        bytes_rounds = totals[("all-to-all", ("expert",))][1]
        formula = 4 * ran * experts * c * embed * 4
        flops = [program.matmul_flops(compiled[0]), program.matmul_flops(compiled[1], shares)]
        states, ratios = [padded[0], rounds[0]], []
        for _ in range(repeats):  # alternating, so both see the same machine load
            states[0], ms_padded = timed(padded[1], states[0])
            states[1], ms_rounds = timed(rounds[1], states[1])
            ratios.append(ms_padded / ms_rounds)
        shapes = ragged_lowered(experts)
        routed_rows = 2 * tokens  # N k
        bound = mesh.shape["expert"] * tokens * min(2, experts // mesh.shape["expert"])
        dispatch = (routed_rows, embed, bound)
        assert sorted(shapes) == sorted([dispatch, (bound, embed, routed_rows)] * 2), shapes
        bytes_ragged = (2 * routed_rows + 2 * ragged_received(experts)) * embed * 4
        row = dict(experts=experts, rounds=ran, most=most, bytes_padded=bytes_padded,
                   bytes_rounds=bytes_rounds, formula=formula, bytes_ragged=bytes_ragged,
                   ragged_buffer_rows=bound, flops_padded=flops[0],
                   flops_rounds=flops[1], time_ratio=statistics.median(ratios))
        table.append(row)
        print(f"{experts:>3} {f'{ran}/{most}':>7} {bytes_padded:>17,} {bytes_rounds:>9,.0f} "
              f"{formula:>9,} {bytes_ragged:>9,} {flops[0] / 1e6:>13.1f} "
              f"{flops[1] / 1e6:>8.1f} {row['time_ratio']:>23.2f}")
    return table


if __name__ == "__main__":
    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    compare()
