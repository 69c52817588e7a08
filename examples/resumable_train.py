"""Resumable training: stop a run (or lose it), start it again, and it carries on exactly.

    python examples/resumable_train.py --steps 40 --stop-after 15   # "crashes" after step 15
    python examples/resumable_train.py --steps 40                   # resumes from step 10
    python examples/resumable_train.py --steps 60 --strategy zero1  # another layout, same run

A GPT tiny trains on the text shipped with parallax. Every ``--save-every`` steps a
``px.checkpoint.Manager`` saves, asynchronously, the sharded state and what the run needs
besides it (``extra``): the data sampler's position (a NumPy generator's state) and the loss
curve. A new run with the same ``--checkpoint-dir`` restores the newest step straight into
the layout of its own ``--strategy`` (which may differ from the one that saved), draws the
same batches from there on, and so continues the original run. The progress bar shows
tokens/s per device, MFU and memory, a table sums them up at the end, and ``--logdir`` and
``--profile-steps`` work as for ``parallax demo``. Without an accelerator it
simulates 8 CPU devices. On a GPU or TPU it computes in bf16 with fp32 master parameters and
optimizer (``px.MixedPrecision``), on CPU in fp32 (``--precision`` chooses); the checkpoint
holds the fp32 state either way, so a run resumed at another ``--precision`` continues from
the same state but not with the same numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

from parallax.cli import simulate_cpu_devices
from parallax.metrics import add_arguments as px_metrics_arguments
from parallax.precision import add_arguments as add_precision_argument
from parallax.precision import compute_dtype_from_flag


class TextSampler:
    """Random windows of a token array; ``state()`` is its position, as JSON values."""

    def __init__(self, tokens, batch: int, seq_len: int, seed: int = 0, state=None):
        import numpy as np

        self.tokens, self.batch, self.seq_len = tokens, batch, seq_len
        self.rng = np.random.default_rng(seed)
        if state is not None:
            self.rng.bit_generator.state = state
        self.np = np

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def next(self) -> dict:
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch)
        return {"tokens": self.np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])}


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="train until this step")
    parser.add_argument("--checkpoint-dir",
                        default=os.path.join(tempfile.gettempdir(), "parallax_resumable_train"))
    parser.add_argument("--strategy", default="dp+fsdp+tp", help="as for parallax demo")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this step without a final save, as a crash would")
    parser.add_argument("--batch", type=int, default=16)
    args = px_metrics_arguments(add_precision_argument(parser)).parse_args(argv)
    print(simulate_cpu_devices(8))

    import jax
    import optax
    from flax import nnx

    import parallax as px
    from parallax.cli import presets
    from parallax.cli.demo import demo_tokens

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU
    config = px.models.GPTConfig.tiny(dtype=compute)
    axes, strategy = presets.parse(args.strategy, devices=jax.device_count())
    if compute != "float32":  # float32 master parameters and optimizer
        strategy = px.compose(strategy, px.MixedPrecision(compute=compute))
    mesh = px.make_mesh(**axes, devices=jax.devices()[:math.prod(axes.values())])

    def make_state():
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adamw(3e-3))

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tokens = demo_tokens()
    with px.checkpoint.Manager(args.checkpoint_dir, save_every=args.save_every,
                               max_to_keep=3) as manager:
        if manager.latest_step() is None:
            state, losses, sampler = px.init(make_state, mesh, strategy), [], None
            print(f"no checkpoint in {args.checkpoint_dir}: starting at step 0")
        else:
            state, at, extra = manager.restore(like=make_state, mesh=mesh, strategy=strategy)
            losses, sampler = extra["losses"], extra["sampler"]
            print(f"resumed from step {at} of {args.checkpoint_dir} (saved under "
                  f"{extra['strategy']}), now {args.strategy} on {px.mesh.describe(mesh)}")
        sampler = TextSampler(tokens, args.batch, config.max_seq_len, state=sampler)

        def extra():  # what the run needs besides the state, as JSON values
            return {"losses": losses, "sampler": sampler.state(), "strategy": args.strategy}

        tokens = args.batch * config.max_seq_len
        monitor = px.metrics.Monitor(
            items_per_step=tokens, flops_per_step=px.models.flops_per_token(config) * tokens,
            logdir=args.logdir, profile_steps=args.profile_steps, first_step=len(losses) + 1,
            description=f"{args.strategy} on {px.mesh.describe(mesh)}")
        stopped = False
        with monitor:  # a resumed run appends to --logdir's metrics.jsonl from its next step
            for i in monitor.loop(range(int(state.step), args.steps)):
                state, metrics = step(state, sampler.next())
                losses.append(float(metrics["loss"]))
                monitor.step(metrics, loss=losses[-1])
                manager.save(i + 1, state, extra())  # only every --save-every steps
                stopped = args.stop_after is not None and i + 1 >= args.stop_after
                if stopped:
                    break
        if monitor.meter.history:
            print(monitor.table())
        if stopped:
            print(f"stopping after step {len(losses)} (the newest checkpoint is step "
                  f"{manager.latest_step()})")
            return losses
        if manager.latest_step() != len(losses):
            manager.save(len(losses), state, extra(), force=True)
    print(f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
