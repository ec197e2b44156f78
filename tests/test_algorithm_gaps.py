"""Hand-computed checks of formulas that mutation testing found unpinned by the other tests.

Each test names the mutation it kills; every expected number is worked out by hand in the comments.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from comarl.algorithms import aggregate_loss, group_advantages, token_entropy, whiten
from comarl.engines import SamplingParams, next_tokens

# ----------------------------------------------------------------------------- group_advantages


@pytest.mark.parametrize("baseline", ["group_mean", "leave_one_out", "group_max"])
def test_a_flat_group_is_exactly_zero_beside_a_spread_group(baseline):
    """The all-equal rule is per group, not per batch (mutation: ``flat`` from the whole batch's max == min).

    Group 0 is six float32 0.3s: their mean rounds to 0.3 + 2.98e-8, std ~3.3e-8, so without the rule
    R - mean = -2.98e-8 and / (3.3e-8 + 1e-4) gives ~ -3e-4, not 0. Group 1 = [0, 1, 0, 1, 0, 1] is spread,
    so the batch as a whole is not flat.
    group_mean, group 1: mean 1/2, A = +-1/2; unbiased std = sqrt(6 * 1/4 / 5) = sqrt(0.3) ~ 0.5477226
    -> A = +-0.5 / (0.5477226 + 1e-4) = +-0.9127043.
    """
    returns = torch.tensor([[0.3] * 6, [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]])
    assert float((returns[0] - returns[0].mean()).abs().max()) > 0  # the rounding the rule removes
    got = group_advantages(returns, baseline, "group")
    assert torch.equal(got[0], torch.zeros(6))
    if baseline == "group_mean":
        a = 0.5 / (math.sqrt(0.3) + 1e-4)
        assert_close(got[1], torch.tensor([-a, a, -a, a, -a, a]))


# ----------------------------------------------------------------------------- aggregate_loss


def test_grpo_aggregation_of_a_fully_masked_sequence_adds_zero_not_nan():
    """A truncated completion under ``mask_truncated_completions`` has an all-zero mask: its length is clamped to 1,
    so it adds 0 / 1 = 0 (mutation: no clamp -> 0 / 0 = NaN for the whole loss).

    row 0: (1 + 2 + 3) / 3 = 2;  row 1: nothing scored -> 0;  (2 + 0) / 2 sequences = 1.
    """
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    got = aggregate_loss(loss, mask, "grpo", num_sequences=2, num_tokens=3, max_completion_length=4)
    assert got.item() == 1.0


def test_dr_grpo_divides_by_max_completion_length_not_the_micro_batch_width():
    """Dr. GRPO's normaliser is the constant S * L_max, even when a micro-batch's completions are all shorter
    than ``max_completion_length`` (mutation: ``mask.shape[1]``, the padded width of this micro-batch).

    Width 3 < L_max = 8: scored losses 1 + 2 + 3 + 4 = 10; 10 / (2 sequences * 8) = 0.625 (not 10 / 6).
    """
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    got = aggregate_loss(loss, mask, "dr_grpo", num_sequences=2, num_tokens=4, max_completion_length=8)
    assert got.item() == pytest.approx(0.625)


# ----------------------------------------------------------------------------- token_entropy, whiten


def test_token_entropy_divides_the_logits_by_the_temperature():
    """logits [0, ln 4] at T = 2 -> [0, ln 2] -> p = [1/3, 2/3]:
    H = ln 3 - (2/3) ln 2 = 1.0986123 - 0.4620981 = 0.6365142.
    (Mutation: temperature ignored -> p = [1/5, 4/5], H = ln 5 - (4/5) ln 4 = 0.5004024.)
    """
    logits = torch.tensor([[[0.0, math.log(4.0)]]])
    assert_close(token_entropy(logits, temperature=2.0), torch.tensor([[0.6365142]]))
    assert_close(token_entropy(logits), torch.tensor([[0.5004024]]))


def test_whiten_two_different_values():
    """Two values are enough to whiten (mutation: ``numel() <= 2`` gives zeros).
    [1, 3]: mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt 2 -> [-1, 1] / sqrt 2 = [-0.7071068, 0.7071068].
    """
    assert_close(whiten(torch.tensor([1.0, 3.0])), torch.tensor([-0.7071068, 0.7071068]))


# ----------------------------------------------------------------------------- next_tokens: the inverse-CDF draw


def test_inverse_cdf_draw_by_hand():
    """p = [1/4, 1/4, 1/4, 1/4, 0] (exact in float32): cdf = [.25, .5, .75, 1, 1].
    u = (1 - U) * c[-1] = 1 - U, and the token is the first i with c[i] >= u:
        U = 0    -> u = 1    -> token 3 (never token 4, of probability 0)
        U = 0.5  -> u = .5   -> token 1 (c[1] = .5 >= .5: ``>=``, not ``>``)
        U = 0.75 -> u = .25  -> token 0
        U = 0.9  -> u = .1   -> token 0
    Mutations killed: ``u = U * c[-1]`` (U = 0 -> u = 0 -> token 0; U = .9 -> token 3) and
    ``searchsorted(right=True)`` (U = 0 -> past the end -> clamped to the impossible token 4; U = .5 -> token 2).
    """
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -math.inf]]).expand(4, 5)
    draw = torch.tensor([[0.0], [0.5], [0.75], [0.9]])
    got = next_tokens(logits, SamplingParams(), torch.tensor([9]), draw=draw)
    assert got.tolist() == [3, 1, 0, 0]


def test_a_draw_of_zero_never_picks_an_impossible_last_token_when_the_cdf_sums_below_one():
    """In float32 the CDF can end a rounding step below 1 (softmax([0, 2, -inf]) sums to 0.99999994): ``u`` is
    scaled by ``c[-1]`` so that U = 0 still lands on the last possible token (mutation: ``u = 1 - U`` finds no
    ``c[i] >= 1`` and is clamped to the last id, here of probability 0)."""
    torch.manual_seed(0)
    logits = torch.cat([torch.randn(64, 6) * 3, torch.full((64, 1), -math.inf)], dim=1)
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    assert (cdf[:, -1] < 1).any()  # the rounding the scaling guards against
    got = next_tokens(logits, SamplingParams(), torch.tensor([99]), draw=torch.zeros(64, 1))
    assert (got < 6).all()
