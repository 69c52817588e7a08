"""TensorFlow's custom-training loop on 8 replicas equals one device (fp32, 5 steps)."""

import jax
import pytest

import parallax as px
from .tf_testing import train_mirrored, train_one_device



@pytest.mark.parametrize("batch_norm", [False, True], ids=["mlp", "batchnorm"])
def test_custom_training_loop_equals_one_device(batch_norm):
    ref_losses, ref_state, ref_accuracy = train_one_device(batch_norm)
    losses, state, accuracy = train_mirrored(px.tf.MirroredStrategy(), batch_norm)
    assert px.testing.relative_difference(losses, ref_losses) <= 1e-5
    # Parameters and, with BatchNorm, its moving statistics (sync-on-read, MEAN).
    assert px.testing.relative_difference(state, ref_state) <= 1e-5
    # The accuracy metric's total and count are sync-on-read SUM variables.
    assert accuracy == ref_accuracy
    if batch_norm:
        assert jax.tree.leaves(state["norm"]["mean"])[0].sharding.is_fully_replicated
