"""What ``px.train_step`` costs over a hand-written ``jax.jit`` of the same step.

Both programs train the same GPT with the same shardings: the hand-written one is a
``jax.jit`` with ``NamedSharding`` in/out shardings (taken from parallax's layout, so the
layout is identical), ``jax.value_and_grad`` and an optax update, leaving every collective to
XLA. The model's activation constraints (``px.constrain``) resolve through the same rules in
both, since without them XLA picks different (here: worse) activation layouts and the two
programs would differ in more than what parallax adds. They are timed alternately in one run (shared machines are noisy: only the ratio of two
programs measured together means anything), and their compiled programs are compared
collective by collective.

parallax's default ``"explicit"`` style writes the data-parallel collectives itself (so ZeRO
reduce-scatters on every backend); its ``"gspmd"`` style leaves them to XLA like the
hand-written step. The table shows both.

Usage:
  python benchmarks/overhead.py [--model tiny|small] [--strategy dp+fsdp+tp] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--strategy", default="dp+fsdp+tp")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed calls of each program")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(args.devices))
    import dataclasses
    import math

    import jax
    import optax
    from flax import nnx

    import parallax as px
    from parallax.step import batch as batch_lib
    from parallax import context
    from parallax.cli import presets
    from parallax.analysis import hlo
    from parallax.mesh import describe
    from parallax.cli.demo import batches, demo_tokens

    config = getattr(px.models.GPTConfig, args.model)()
    axes, explicit = presets.parse(args.strategy, devices=jax.device_count())
    gspmd = dataclasses.replace(explicit, style="gspmd")
    mesh = px.make_mesh(**axes, devices=jax.devices()[: math.prod(axes.values())])
    batch = next(batches(demo_tokens(), args.batch, config.max_seq_len, 1))

    tx = optax.adamw(1e-3)  # one optimizer object: every state then has the same tree structure

    def make_state():
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), tx)

    def px_step(strategy):
        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}
        return step

    programs = {"px explicit": (explicit, px_step(explicit)), "px gspmd": (gspmd, px_step(gspmd))}

    # The hand-written step: the same layout, plain JAX inside.
    state0 = px.init(make_state, mesh, explicit)
    state_sh = programs["px explicit"][1].state_shardings(state0)
    batch_sh = jax.tree.map(
        lambda _: jax.NamedSharding(mesh, batch_lib.batch_spec(explicit)), batch)

    def hand_step(state, batch):
        # The model's px.constrain calls resolve through the same rules, so both programs
        # carry the same activation constraints; nothing else of parallax runs here.
        with context.activate(context.StepContext(mesh, gspmd)):
            def loss(params):
                model = nnx.merge(state.graphdef, params, state.rest)
                return px.models.next_token_loss(model, batch)
            value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads), {"loss": value}

    hand = jax.jit(hand_step, in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, None), donate_argnums=(0,))

    states, compiled = {}, {}
    for name, (strategy, step) in programs.items():
        states[name] = px.init(make_state, mesh, strategy)
        compiled[name] = step.lower(states[name], batch).compile()
    states["hand-written jit"] = px.init(make_state, mesh, explicit)
    with jax.set_mesh(mesh):
        compiled["hand-written jit"] = hand.lower(states["hand-written jit"], batch).compile()
    runners = {name: step for name, (_, step) in programs.items()}
    runners["hand-written jit"] = hand

    times = {name: [] for name in runners}
    with jax.set_mesh(mesh):  # the hand-written step's constraints need the mesh in context
        for _ in range(2):  # warm-up
            for name, run in runners.items():
                states[name], m = run(states[name], batch)
                jax.block_until_ready(m)
        for _ in range(args.steps):  # alternate, so drifts in machine load hit all equally
            for name, run in runners.items():
                start = time.perf_counter()
                states[name], m = run(states[name], batch)
                jax.block_until_ready((states[name], m))
                times[name].append(time.perf_counter() - start)

    # Host time per call, apart from the device work: the same state through a step that
    # does nothing (it returns the state and an empty dict), so a call costs its dispatch
    # only; parallax's own cost per call is the difference to a plain jax.jit of it.
    def noop(state, batch):
        return state, {}

    noop_px = px.train_step(mesh, explicit)(noop)
    noop_jit = jax.jit(noop, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                       donate_argnums=(0,))
    noops = {"px.train_step": noop_px, "jax.jit": noop_jit}
    noop_states = {name: px.init(make_state, mesh, explicit) for name in noops}
    dispatch = {name: [] for name in noops}
    with jax.set_mesh(mesh):
        for i in range(20 + 10 * args.steps):
            for name, run in noops.items():
                start = time.perf_counter()
                noop_states[name], _ = run(noop_states[name], batch)
                elapsed = time.perf_counter() - start
                jax.block_until_ready(noop_states[name])
                if i >= 20:
                    dispatch[name].append(elapsed)

    base = statistics.median(times["hand-written jit"])
    hand_colls = sorted((s.kind, s.axes, s.count, s.message_bytes)
                        for s in hlo.summarize(hlo.collectives(compiled["hand-written jit"], mesh)))
    print(f"\nGPT {args.model}, {explicit.name}, mesh {describe(mesh)}, "
          f"batch {args.batch}, {args.steps} alternating calls each")
    print(f"{'program':<20}{'median ms':>11}{'ratio':>8}   same collectives as hand-written")
    for name in runners:
        med = statistics.median(times[name])
        colls = sorted((s.kind, s.axes, s.count, s.message_bytes)
                       for s in hlo.summarize(hlo.collectives(compiled[name], mesh)))
        same = "yes" if colls == hand_colls else "no"
        print(f"{name:<20}{med * 1e3:>11.2f}{med / base:>8.3f}   {same}")
    print("\ntarget: px gspmd / hand-written <= 1.02 with the same collectives")
    jit_us = statistics.median(dispatch["jax.jit"]) * 1e6
    print(f"\nhost time per call of a step that does nothing ({len(jax.tree.leaves(state0))} "
          f"state leaves), {len(dispatch['jax.jit'])} alternating calls each")
    print(f"{'program':<20}{'median us':>11}{'beyond jit':>12}")
    for name in noops:
        us = statistics.median(dispatch[name]) * 1e6
        print(f"{name:<20}{us:>11.1f}{us - jit_us:>12.1f}")
    # The same wrapper around a stub instead of the jitted program: parallax's own Python per
    # call, exactly (the line above is a difference of two noisy dispatch times).
    own = px.train_step(mesh, explicit)(noop)
    own._jitted = lambda state, batch: (state, {})
    start = time.perf_counter()
    for _ in range(10_000):
        own(state0, batch)
    own_us = (time.perf_counter() - start) / 10_000 * 1e6
    print(f"{'px.train_step own':<20}{own_us:>11.1f}{'':>12}   (its Python around a stub program)")
    print("target: px.train_step <= 50 us per call beyond jax.jit's own dispatch")
    for name in ("px explicit", "hand-written jit"):
        print(f"\ncollectives of {name}:")
        print(hlo.table(hlo.collectives(compiled[name], mesh)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
