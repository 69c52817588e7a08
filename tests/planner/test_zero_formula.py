"""ZeRO's memory formula in the paper's own terms: mixed precision, K = 12, the 7.5B-parameter
model on 64 devices of the paper's figure 1 (120, 31.4, 16.6 and 1.9 GB per device)."""

import pytest

from parallax.planner.predicted import zero as zero_memory

PAPER = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # GB per device, Rajbhandari et al. figure 1
PSI, N = 7.5e9, 64


@pytest.mark.parametrize("stage", list(PAPER))
def test_model_states_reproduce_the_papers_figure(stage):
    gb = zero_memory.zero_model_states_bytes(PSI, stage, N) / 1e9
    assert round(gb, 1) == PAPER[stage]


@pytest.mark.parametrize("stage", list(PAPER))
def test_state_and_gradient_formulas_in_mixed_precision_add_up_to_it(stage):
    """bf16 / fp16 parameters and gradients, fp32 master weights and two fp32 moments:
    K = 2 * 4 + 4 = 12 bytes of optimizer state per parameter."""
    state = zero_memory.zero_state_bytes(PSI, stage, N, param_bytes=2, moments=2, moment_bytes=4,
                                    master_bytes=4)
    grads = zero_memory.zero_gradient_bytes(PSI, stage, N, grad_bytes=2)
    assert (state + grads) == pytest.approx(zero_memory.zero_model_states_bytes(PSI, stage, N))
    assert round((state + grads) / 1e9, 1) == PAPER[stage]


def test_fp32_defaults_are_unchanged():
    assert zero_memory.zero_state_bytes(1_000_000, 0, 8) == 12_000_000  # 4 + 2 x 4 bytes
    assert zero_memory.zero_state_bytes(1_000_000, 3, 8) == 1_500_000
