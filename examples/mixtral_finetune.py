"""Fine-tune a Mixtral checkpoint under data x expert x tensor parallelism, and save it back.

    python examples/mixtral_finetune.py --steps 10                       # a tiny random one
    python examples/mixtral_finetune.py --checkpoint ~/Mixtral-dir --out finetuned/
    python examples/mixtral_finetune.py --steps 3 --precision bf16       # bf16 on CPU too

``px.models.from_pretrained`` reads a ``mixtral`` checkpoint (``config.json`` and
safetensors, as transformers' ``save_pretrained`` writes) into ``px.models.Llama`` with MoE
blocks, each device reading only its experts' slices. Routing is the checkpoint's (softmax,
top-2 renormalised, dropless) and the auxiliary loss Mixtral's (``aux_loss="mixtral"``:
pooled over layers, ``router_aux_loss_coef``, only with ``output_router_logits``). Without
``--checkpoint`` the script writes a tiny random Mixtral first. It trains with
``moe_next_token_loss``, printing the loss and the tokens per expert, checks the loss curve
against one device, and writes the result with ``px.models.save_pretrained``, which
transformers' ``MixtralForCausalLM.from_pretrained`` reads. On a GPU or TPU it computes in
bf16 with fp32 master parameters and optimizer (``px.MixedPrecision``, and the loaded model's
compute dtype set to bf16: its parameters stay float32 as ``from_pretrained`` read them, the
router computes in float32), on CPU in fp32 (``--precision`` chooses); the one-device
reference computes in fp32 and the loss curves must agree within 1e-4 relative in fp32, 3e-2
in bf16. The saved checkpoint holds the float32 master parameters.
"""

from __future__ import annotations

import argparse
import sys
import tempfile


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpoint", help="a mixtral checkpoint directory")
    parser.add_argument("--out", help="where to save the fine-tuned checkpoint")
    from parallax.precision import add_arguments as add_precision_argument

    args = add_precision_argument(parser).parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax
    import optax
    from flax import nnx

    import parallax as px
    from parallax.cli.demo import batches, demo_tokens
    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU

    work = tempfile.mkdtemp()
    path = args.checkpoint
    if path is None:  # a tiny random Mixtral, as a stand-in for the Hub's files
        moe = px.models.MoEConfig(num_experts=4, top_k=2, capacity_factor=None,
                                  aux_loss="mixtral", balance_coef=0.02)
        config = px.models.LlamaConfig.tiny(max_seq_len=32, rope_scaling=None, moe=moe)
        path = f"{work}/mixtral"
        px.models.save_pretrained(path, px.models.Llama(config, rngs=nnx.Rngs(0)))

    expert = 2 if jax.device_count() % 8 == 0 else 1
    mesh = px.make_mesh(data=jax.device_count() // (2 * expert) or 1, expert=expert,
                        tensor=2 if jax.device_count() % 2 == 0 else 1)
    strategy = px.compose(px.DataParallel("data"), px.ExpertParallel("expert"),
                          px.TensorParallel("tensor"))
    model = px.models.from_pretrained(path, mesh=mesh, strategy=strategy,
                                      compute_dtype=compute)  # parameters stay float32
    if compute != "float32":  # the step casts the float32 parameters to bf16
        strategy = px.compose(strategy, px.MixedPrecision(compute=compute))
    moe = model.config.moe
    print(f"loaded {path}: {moe.num_experts} experts, top-{moe.top_k}, aux loss "
          f"{moe.aux_loss!r} x {moe.balance_coef}; w_gate sharded as "
          f"{model.blocks.mlp.w_gate[...].sharding.spec} over {dict(mesh.shape)}; "
          f"computing in {compute} (parameters and optimizer float32)")
    tx = optax.adamw(1e-3)
    data = list(batches(demo_tokens(), 8, min(32, model.config.max_seq_len), args.steps))

    @px.train_step(mesh, strategy)
    def step(state, batch):
        (loss, stats), grads = px.value_and_grad(px.models.moe_next_token_loss,
                                                 has_aux=True)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss, **stats}

    state = px.shard(px.TrainState.create(model, tx), mesh, strategy)
    losses = []
    for i, batch in enumerate(data):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        load = jax.device_get(m["expert_load"]).mean(0) * moe.num_experts
        print(f"step {i + 1}: loss {losses[-1]:.4f} (cross-entropy "
              f"{float(m['cross_entropy']):.4f}, balance {float(m['load_balance_loss']):.3f}), "
              f"load/even {' '.join(f'{x:.2f}' for x in load)}")

    reference = px.testing.train(  # in fp32: what the bf16 run should stay near
        lambda: px.TrainState.create(px.models.from_pretrained(path), tx),
        lambda mdl, b: px.models.moe_next_token_loss(mdl, b)[0], data)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference.losses))
    tolerance = 1e-4 if compute == "float32" else 3e-2
    print(f"loss curve vs one device (fp32): largest relative difference {worst:.1e} "
          f"(tolerance {tolerance:.0e}, {compute})")
    out = args.out or f"{work}/finetuned"
    px.models.save_pretrained(out, state)
    print(f"saved to {out} (transformers.MixtralForCausalLM.from_pretrained reads it)")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
