"""px.plan's choice against brute force, on model sizes and device counts no other test uses.

Every candidate is compiled (``exhaustive=True``); the planner's choice (``top_k=2``) must
fit and be within 10% of the best compiled-roofline time among those that fit, with no
budget and with the median compiled peak as budget. ``benchmarks/plan.py --validate``
prints the same table.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.planner.candidates import SearchSpace

SPACE = SearchSpace(zero_stages=(3,), sequence_parallel=(False,), schedules=("1f1b",),
                    microbatches_per_stage=(2,), max_tensor=2, max_stages=2)  # CI time


def case(model):
    if model == "mlp":
        make = lambda: px.TrainState.create(  # noqa: E731
            px.models.MLP(24, [96, 96], 24, rngs=nnx.Rngs(0)), optax.adam(1e-3))
        return make, px.models.mse_loss, {"x": jnp.ones((12, 24)), "y": jnp.zeros((12, 24))}
    config = px.models.GPTConfig.tiny(num_layers=6, max_seq_len=32)
    make = lambda: px.TrainState.create(  # noqa: E731
        px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adam(1e-3))
    return make, px.models.next_token_stages, {
        "tokens": jax.ShapeDtypeStruct((12, config.max_seq_len + 1), jnp.int32)}


def validate(model, devices):
    """``(brute-force plan, [(budget, chosen, best)])``."""
    make, loss_fn, batch = case(model)
    brute = px.plan(make, loss_fn, batch, devices=devices, space=SPACE, exhaustive=True)
    compiled = [e for e in brute.evaluations if e.compiled_peak is not None]
    peaks = sorted(e.compiled_peak for e in compiled)
    out = []
    for budget in (None, peaks[len(peaks) // 2]):
        chosen = px.plan(make, loss_fn, batch, devices=devices, space=SPACE, top_k=2,
                         memory_per_device=budget).best
        best = min((e for e in compiled if budget is None or e.compiled_peak <= budget),
                   key=lambda e: e.compiled_time)
        out.append((budget, chosen, best))
    return brute, out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("devices", [3, 6])
def test_the_choice_is_within_10_percent_of_brute_force(model, devices):
    brute, results = validate(model, devices)
    for budget, chosen, best in results:
        assert budget is None or chosen.compiled_peak <= budget
        assert chosen.compiled_time <= 1.10 * best.compiled_time, (
            f"chose {chosen.candidate.label}, brute force {best.candidate.label}\n"
            + brute.table(30))
