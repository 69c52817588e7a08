"""MoE under expert parallelism: all-to-all bytes vs experts per device, and load balance.

    python benchmarks/moe.py            # a short CPU run (8 simulated devices)

Part 1 compiles the DP x EP step (``data=2, expert=4``) of a 2-layer MoE GPT for 4, 8 and
16 experts (1, 2, 4 per device) and reads the all-to-alls from the compiled HLO: their
count per step and bytes per device, against the prediction ``4 L G E C D x 4 bytes``
(two all-to-alls forward and two backward per layer, each moving this device's
``[G, E, C, D]`` slots). Step time is printed too, but on simulated CPU devices it only
ranks programs of the same run. Part 2 trains 20 steps with and without the Switch
load-balancing loss and prints, per step, the busiest expert's share of the routing choices
relative to an even share (1.0 is perfect balance) and the dropped fraction. Part 3
(``benchmarks/moe_dropless.py``) compares dropless padded to ``C = S`` with dropless in
rounds: all-to-all bytes and matmul FLOPs from the compiled programs, step time alternating.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px
    from parallax.analysis import hlo
    from parallax.cli.demo import batches, demo_tokens

    mesh = px.make_mesh(data=2, expert=4)
    strategy = px.compose(px.DataParallel("data"), px.ExpertParallel("expert"))
    rows, seq, layers, embed = 16, 32, 2, 64

    def build(experts, balance_coef=0.01, steps=3):
        moe = px.models.MoEConfig(num_experts=experts, top_k=2, capacity_factor=1.25,
                                  balance_coef=balance_coef)
        cfg = px.models.GPTConfig.tiny(num_layers=layers, mlp_dim=128, max_seq_len=seq,
                                       embed_dim=embed, moe=moe)
        state = px.init(lambda: px.TrainState.create(
            px.models.GPT(cfg, rngs=nnx.Rngs(0)), optax.adam(1e-3)), mesh, strategy)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            (loss, stats), grads = px.value_and_grad(px.models.moe_next_token_loss,
                                                     has_aux=True)(state.model, batch)
            return state.apply_gradients(grads), stats

        data = list(batches(demo_tokens(), rows, seq, steps))
        return cfg, state, step, data

    print("\nall-to-all per step (per device), data=2 x expert=4, top-2, capacity 1.25")
    print(f"{'experts':>8} {'per dev':>8} {'count':>6} {'bytes':>10} {'predicted':>10} "
          f"{'ms/step':>8} {'tokens/s':>9}")
    for experts in (4, 8, 16):
        cfg, state, step, data = build(experts)
        found = hlo.collectives(step.lower(state, data[0]).compile(), mesh)
        a2a = hlo.total_bytes(found, "all-to-all")
        predicted = (4 * layers * (rows // mesh.size) * experts * cfg.moe.capacity(seq)
                     * embed * 4)
        state, _ = step(state, data[0])
        jax.block_until_ready(state)
        start = time.perf_counter()
        for batch in data[1:]:
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        ms = (time.perf_counter() - start) / (len(data) - 1) * 1e3
        print(f"{experts:>8} {experts // 4:>8} {hlo.count(found, 'all-to-all'):>6} "
              f"{a2a:>10,} {predicted:>10,} {ms:>8.1f} {rows * seq / ms * 1e3:>9,.0f}")

    print("\nload balance over 20 steps, 8 experts: busiest expert's share / even share")
    for coef in (0.0, 1.0):
        _, state, step, data = build(8, balance_coef=coef, steps=20)
        peaks, drops = [], []
        for batch in data:
            state, stats = step(state, batch)
            load = np.asarray(stats["expert_load"]) * 8  # [layers, experts], 1.0 = even
            peaks.append(float(load.max()))
            drops.append(float(stats["dropped_fraction"]))
        print(f"balance_coef={coef}: max load/even per step "
              f"{' '.join(f'{p:.2f}' for p in peaks)}")
        print(f"{'':>17} dropped: first {drops[0]:.1%}, last {drops[-1]:.1%}, "
              f"mean {np.mean(drops):.1%}")

    from moe_dropless import compare  # this folder, on the path when run as a script

    compare()
    return 0


if __name__ == "__main__":
    sys.exit(main())
