"""The tensor math of comarl.algorithms (and the joint-action index helper), checked against hand computations."""

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from comarl.algorithms import (
    aggregate_loss,
    clipped_surrogate,
    completion_lengths,
    cross_returns,
    discounted_returns,
    group_advantages,
    kl_k3,
    sequence_kl_k1,
    to_width,
    token_entropy,
    token_logprobs,
    truncated_completions,
)
from comarl.engines import completion_mask
from comarl.rollout import joint_action_indices

EPS = 1e-4  # group_advantages' default eps, added to the std

# Two groups of G = 4 returns.
RETURNS = [[1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 1.0, 1.0]]
GREEDY = [4.0, 0.25]  # reward of each group's greedy joint action (MAReMax baseline)

# A = R - b by hand, per baseline:
#   group_mean:    b = [3, 0.5]                    -> [-2, -1, 0, 3], [-.5, -.5, .5, .5]
#   none:          b = 0                           -> R
#   leave_one_out: sums [12, 2], b_i = (sum - R_i)/3
#                  row 1: b = [11/3, 10/3, 3, 2]   -> [-8/3, -4/3, 0, 4]      (= 4/3 * group_mean row 1)
#                  row 2: b = [2/3, 2/3, 1/3, 1/3] -> [-2/3, -2/3, 2/3, 2/3]  (= 4/3 * group_mean row 2)
#   group_max:     b = [6, 1]                      -> [-5, -4, -3, 0], [-1, -1, 0, 0]
#   greedy:        b = [4, 0.25]                   -> [-3, -2, -1, 2], [-.25, -.25, .75, .75]
CENTERED = {
    "group_mean": [[-2.0, -1.0, 0.0, 3.0], [-0.5, -0.5, 0.5, 0.5]],
    "none": RETURNS,
    "leave_one_out": [[-8 / 3, -4 / 3, 0.0, 4.0], [-2 / 3, -2 / 3, 2 / 3, 2 / 3]],
    "group_max": [[-5.0, -4.0, -3.0, 0.0], [-1.0, -1.0, 0.0, 0.0]],
    "greedy": [[-3.0, -2.0, -1.0, 2.0], [-0.25, -0.25, 0.75, 0.75]],
}
# Scales (unbiased std, divisor G - 1 = 3, or 8 - 1 = 7 for the batch):
#   group: row 1 mean 3, squared deviations 4 + 1 + 0 + 9 = 14   -> std sqrt(14/3) ~ 2.1602
#          row 2 mean .5, squared deviations 4 * .25 = 1         -> std sqrt(1/3)  ~ 0.5774
#   batch: 8 returns, sum 14, mean 1.75; squared deviations
#          .5625 + .0625 + 1.5625 + 18.0625 + 3.0625 + 3.0625 + .5625 + .5625 = 27.5 -> std sqrt(27.5/7) ~ 1.9821
DIVISORS = {
    "group": [[math.sqrt(14 / 3) + EPS], [math.sqrt(1 / 3) + EPS]],
    "batch": [[math.sqrt(27.5 / 7) + EPS]],
    "none": [[1.0]],
}


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


# ----------------------------------------------------------------------------- group_advantages


@pytest.mark.parametrize(
    ("baseline", "scale"),
    [(b, sc) for b in ("group_mean", "leave_one_out", "group_max") for sc in ("group", "batch", "none")]
    + [("none", "none"), ("greedy", "none")],
)
def test_group_advantages_every_baseline_and_scale(baseline, scale):
    greedy = _t(GREEDY) if baseline == "greedy" else None
    got = group_advantages(_t(RETURNS), baseline=baseline, scale=scale, greedy_returns=greedy)
    expected = _t(CENTERED[baseline]) / _t(DIVISORS[scale])
    assert got.shape == (2, 4)
    assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_group_advantages_spot_values():
    # group_mean + group, row 1, last sample: 3 / (sqrt(14/3) + 1e-4) = 3 / 2.1603474 = 1.388665...
    got = group_advantages(_t(RETURNS))
    assert got[0, 3].item() == pytest.approx(3 / (2.160246899469287 + 1e-4), rel=1e-9)
    # without the eps the value would be 1.388730..., which the tolerance above rejects
    assert got[0, 3].item() != pytest.approx(3 / 2.160246899469287, rel=1e-6)


def test_group_advantages_default_eps_is_1e_4():
    # row 2 only: A = [-.5, -.5, .5, .5], std sqrt(1/3) = 0.57735 -> .5 / (0.57735 + 1e-4) = 0.865875...
    got = group_advantages(_t([[0.0, 0.0, 1.0, 1.0]]))
    assert got[0, 2].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4), rel=1e-12)
    custom = group_advantages(_t([[0.0, 0.0, 1.0, 1.0]]), eps=0.5)
    assert custom[0, 2].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 0.5), rel=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_leave_one_out_is_g_over_g_minus_1_times_group_mean(scale):
    returns = _t(RETURNS)
    loo = group_advantages(returns, baseline="leave_one_out", scale=scale)
    mean = group_advantages(returns, baseline="group_mean", scale=scale)
    assert_close(loo, (4 / 3) * mean)  # G / (G - 1) = 4 / 3


@pytest.mark.parametrize("baseline", ["none", "greedy"])
@pytest.mark.parametrize("scale", ["group", "batch", "turn"])
def test_uncentred_baselines_are_not_scaled(baseline, scale):
    # All four samples right: R - b = 1 stays 1 while the spread is 0, so A would be 1 / eps = 1e4.
    with pytest.raises(ValueError, match=f"scale='{scale}' with baseline='{baseline}' divides uncentred"):
        group_advantages(
            torch.ones(1, 4),
            baseline,
            scale,
            greedy_returns=torch.zeros(1),
            turns=torch.zeros(1, dtype=torch.long),
        )


@pytest.mark.parametrize(("G", "value"), [(6, 0.3), (7, 0.7), (3, 0.1)])
@pytest.mark.parametrize("baseline", ["group_mean", "leave_one_out", "group_max"])
def test_groups_of_equal_returns_get_exactly_zero(G, value, baseline):
    # In float32 the mean of six 0.3s is not 0.3: R - mean is ~1e-8, and / (0 + 1e-4) would give ~3e-4.
    returns = torch.full((1, G), value)
    assert float((returns - returns.mean()).abs().max()) > 0 or G == 3  # the rounding the rule removes
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(returns, baseline, scale), torch.zeros(1, G))


def test_all_equal_group_gives_zero_advantages():
    # R - mean = 0 and std = 0: 0 / (0 + eps) = 0 (finite, not NaN)
    returns = _t([[2.0, 2.0, 2.0, 2.0], [1.0, 2.0, 3.0, 6.0]])
    got = group_advantages(returns, baseline="group_mean", scale="group")
    assert torch.equal(got[0], torch.zeros(4, dtype=torch.float64))
    assert_close(got[1], _t([-2.0, -1.0, 0.0, 3.0]) / (math.sqrt(14 / 3) + EPS))


def test_greedy_uses_each_groups_greedy_return():
    # same returns in both groups, different greedy rewards: b = 1 for group 0, b = 5 for group 1
    returns = _t([[1.0, 2.0], [1.0, 2.0]])
    got = group_advantages(returns, baseline="greedy", scale="none", greedy_returns=_t([1.0, 5.0]))
    assert_close(got, _t([[0.0, 1.0], [-4.0, -3.0]]))


def test_group_advantages_errors():
    returns = _t(RETURNS)
    with pytest.raises(ValueError, match="unknown baseline 'foo'"):
        group_advantages(returns, baseline="foo")
    with pytest.raises(ValueError, match="unknown scale 'bar'"):
        group_advantages(returns, scale="bar")
    with pytest.raises(ValueError, match=r"leave_one_out.*num_generations >= 2"):
        group_advantages(_t([[1.0], [2.0]]), baseline="leave_one_out", scale="none")
    with pytest.raises(ValueError, match=r"baseline='greedy' needs greedy_returns"):
        group_advantages(returns, baseline="greedy", scale="none")
    with pytest.raises(ValueError, match=r"baseline='greedy' needs greedy_returns of shape \[num_groups\]"):
        group_advantages(returns, baseline="greedy", scale="none", greedy_returns=_t([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"returns must be \[num_groups, G\]"):
        group_advantages(_t([1.0, 2.0]))


def test_magrpo_family_defaults_give_different_advantages():
    returns = _t(RETURNS)
    family = {
        "MAGRPO": group_advantages(returns, "group_mean", "group"),
        "MAREINFORCE": group_advantages(returns, "none", "none"),
        "MARLOO": group_advantages(returns, "leave_one_out", "none"),
        "MAReMax": group_advantages(returns, "greedy", "none", greedy_returns=_t(GREEDY)),
    }
    # hand values (see CENTERED / DIVISORS above)
    assert_close(family["MAGRPO"], _t(CENTERED["group_mean"]) / _t(DIVISORS["group"]))
    assert_close(family["MAREINFORCE"], _t(RETURNS))
    assert_close(family["MARLOO"], _t(CENTERED["leave_one_out"]))
    assert_close(family["MAReMax"], _t(CENTERED["greedy"]))
    for (name_a, a), (name_b, b) in itertools.combinations(family.items(), 2):
        assert not torch.allclose(a, b, atol=1e-3), f"{name_a} and {name_b} give the same advantages"

    # The CoMLRL failure mode: re-standardising A itself, (A - mean_j A) / std_j A per group, removes every
    # affine difference, so all four collapse onto (R - mean R) / std R:
    #   row 1: [-2, -1, 0, 3] / sqrt(14/3), row 2: [-.5, -.5, .5, .5] / sqrt(1/3)
    restandardised = {
        name: (a - a.mean(dim=1, keepdim=True)) / a.std(dim=1, keepdim=True) for name, a in family.items()
    }
    collapsed = _t(CENTERED["group_mean"]) / _t([[math.sqrt(14 / 3)], [math.sqrt(1 / 3)]])
    for name, a in restandardised.items():
        assert_close(a, collapsed, msg=f"{name} after re-standardising")


# ----------------------------------------------------------------------------- cross_returns


def test_cross_returns_mean_per_completion():
    # K = 6 joint actions of one group, G = 3; this agent's completion in each and the team reward:
    #   index   0  1  2  0  1  0
    #   reward  1  2  3  4  5  6
    # completion 0: (1 + 4 + 6) / 3 = 11/3; completion 1: (2 + 5) / 2 = 3.5; completion 2: 3 / 1 = 3
    got = cross_returns(_t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), torch.tensor([0, 1, 2, 0, 1, 0]), 3)
    assert_close(got, _t([11 / 3, 3.5, 3.0]))


def test_cross_returns_all_combinations_of_two_agents():
    # G = 2, N = 2, every combination (0,0) (0,1) (1,0) (1,1) with team rewards 1, 2, 3, 4:
    #   agent 0: completion 0 in (0,0),(0,1) -> (1+2)/2 = 1.5; completion 1 -> (3+4)/2 = 3.5
    #   agent 1: completion 0 in (0,0),(1,0) -> (1+3)/2 = 2.0; completion 1 -> (2+4)/2 = 3.0
    joint = joint_action_indices(2, 2, "cross")
    rewards = _t([1.0, 2.0, 3.0, 4.0])
    assert_close(cross_returns(rewards, joint[:, 0], 2), _t([1.5, 3.5]))
    assert_close(cross_returns(rewards, joint[:, 1], 2), _t([2.0, 3.0]))


def test_cross_returns_of_equal_rewards_are_that_reward_exactly():
    """A sampled cross subset credits completions unequally often: completion 0 below is in 3 joint actions,
    completion 1 in 1. Every joint action scored 0.9, so both returns are 0.9 and the group is flat: its
    advantages must be exactly 0. (In float32, 0.9 + 0.9 + 0.9 = 2.6999998 and / 3 = 0.89999992 != 0.9, which
    group scaling then blew up to A = -6e-4 for an answer as good as its sibling.)"""
    rewards = torch.full((4,), 0.9)
    got = cross_returns(rewards, torch.tensor([0, 0, 0, 1]), 2)
    assert got.dtype == torch.float32
    assert got.tolist() == [rewards[0].item()] * 2
    for baseline in ("group_mean", "leave_one_out", "group_max"):
        assert group_advantages(got.unsqueeze(0), baseline, "group").tolist() == [[0.0, 0.0]]


def test_cross_returns_missing_completion_raises():
    with pytest.raises(ValueError, match=r"cross_returns: completions \[1\] appear in no joint action"):
        cross_returns(_t([1.0, 2.0, 3.0]), torch.tensor([0, 0, 2]), 3)


# ----------------------------------------------------------------------------- token_logprobs


def test_token_logprobs_hand_values():
    # logits [1, 2, 3] at both positions; logsumexp = log(e + e^2 + e^3) = log(30.192874) = 3.407606
    #   token 2: 3 - 3.407606 = -0.407606;  token 0: 1 - 3.407606 = -2.407606
    logits = torch.tensor([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]])
    tokens = torch.tensor([[2, 0]])
    lse = math.log(math.e + math.e**2 + math.e**3)
    got = token_logprobs(logits, tokens)
    assert got.shape == (1, 2)
    assert_close(got, torch.tensor([[3 - lse, 1 - lse]]))
    assert_close(got, torch.tensor([[-0.407606, -2.407606]]), rtol=0, atol=1e-6)


def test_token_logprobs_temperature_divides_logits():
    # T = 2: logits / 2 = [0.5, 1, 1.5]; logsumexp = log(e^.5 + e + e^1.5) = log(8.848692) = 2.180270
    #   token 2: 1.5 - 2.180270 = -0.680270;  token 0: 0.5 - 2.180270 = -1.680270
    # (without the temperature they would be -0.407606 / -2.407606, see above)
    logits = torch.tensor([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]])
    tokens = torch.tensor([[2, 0]])
    got = token_logprobs(logits, tokens, temperature=2.0)
    assert_close(got, torch.tensor([[-0.680270, -1.680270]]), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- completion_mask


def test_completion_mask_scores_up_to_first_eos():
    ids = torch.tensor([[5, 7, 2, 0, 0], [5, 2, 2, 3, 3], [4, 4, 4, 4, 4]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(completion_mask(ids, [2]), expected)


def test_completion_mask_several_eos_ids():
    # 9 and 2 both stop; whichever comes first ends the scored part
    ids = torch.tensor([[5, 9, 2, 3], [2, 9, 4, 4], [5, 6, 7, 8], [6, 2, 9, 9]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    assert torch.equal(completion_mask(ids, [2, 9]), expected)


def test_truncated_completions_are_those_without_an_eos_under_their_mask():
    eos = 2
    ids = torch.tensor([[5, 7, 2, 2], [5, 7, 8, 9], [2, 2, 2, 2], [5, 7, 8, 2]])
    mask = completion_mask(ids, [eos])
    # ended early, cut at max_new_tokens, ended at once, ended on the last allowed token
    assert truncated_completions(ids, mask, [eos]).tolist() == [False, True, False, False]
    # pad == eos: a cut completion padded with EOS-valued tokens (unscored) is still cut
    padded = torch.tensor([[5, 7, 8, 2, 2]])
    assert truncated_completions(padded, torch.tensor([[1, 1, 1, 0, 0]]), [eos]).tolist() == [True]
    assert truncated_completions(ids, mask, [9]).tolist() == [True, False, True, True]  # another EOS id


# ----------------------------------------------------------------------------- kl_k3


def test_kl_k3_hand_values():
    # delta = ref - logp
    #   logp = ln .5, ref = ln .25: delta = ln .5 -> .5 - ln .5 - 1 = .5 + .693147 - 1 = 0.193147
    #   logp = ln .25, ref = ln .5: delta = ln 2  -> 2 - ln 2 - 1 = 1 - .693147     = 0.306853
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    got = kl_k3(logp, ref)
    assert_close(got, torch.tensor([math.exp(math.log(0.5)) - math.log(0.5) - 1, 2 - math.log(2) - 1]))
    assert_close(got, torch.tensor([0.193147, 0.306853]), rtol=0, atol=1e-6)


def test_sequence_kl_k1_hand_values():
    """k1 summed over each completion's scored tokens: log pi(y) - log pi_ref(y); may be negative per sample."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -2.0, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert_close(sequence_kl_k1(logp, ref, mask), torch.tensor([0.5 - 1.0, 0.5 + 1.5 + 0.0]))


def test_k1_as_a_reward_gives_the_kl_gradient_and_k3_does_not():
    """Why kl_penalty='reward' uses k1: on a one-token policy (exact expectations), the policy gradient of the
    reward -beta k(y), E_pi[grad log pi(y) (-beta k(y))], is -beta grad KL(pi || ref) for k1; for k3 it is
    -beta [grad KL(pi || ref) - grad KL(ref || pi)] (so CoMLRL's k3 in the returns pushes away in one direction)."""
    torch.manual_seed(0)
    z, ref = torch.randn(5, requires_grad=True), torch.randn(5).log_softmax(0)

    def grad_of(f):
        (g,) = torch.autograd.grad(f(z.log_softmax(0)), z)
        return g

    kl = grad_of(lambda logp: (logp.exp() * (logp - ref)).sum())
    reverse_kl = grad_of(lambda logp: (ref.exp() * (ref - logp)).sum())
    logp = z.log_softmax(0).detach().unsqueeze(1)  # 5 one-token "completions"
    ones, pi = torch.ones(5, 1), logp.exp().squeeze(1)
    for estimate, expected in (
        (sequence_kl_k1(logp, ref.unsqueeze(1), ones), kl),
        (kl_k3(logp, ref.unsqueeze(1), ones).sum(dim=1), kl - reverse_kl),
    ):
        # the policy-gradient loss of rewards -beta k(y) (beta = 1), summed exactly over y
        g = grad_of(lambda lp, k=estimate: -(pi * lp * -k).sum())
        assert_close(g, expected)
    assert (kl - reverse_kl).abs().max() > 0.01  # the two differ on this policy


def test_kl_k3_zero_when_equal_and_never_negative():
    logp = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    assert torch.equal(kl_k3(logp, logp), torch.zeros(3))
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=gen) * 3
    b = torch.randn(1000, generator=gen) * 3
    assert (kl_k3(a, b) >= 0).all()


def test_kl_k3_gradient_flows_to_logprobs_only():
    # d k3 / d logp = -exp(delta) + 1 = 1 - exp(ref - logp) = 1 - .25/.5 = 0.5
    logp = torch.log(torch.tensor([0.5])).requires_grad_()
    with torch.no_grad():
        ref = torch.log(torch.tensor([0.25]))
    kl_k3(logp, ref).sum().backward()
    assert_close(logp.grad, torch.tensor([0.5]))
    assert not ref.requires_grad
    assert ref.grad is None


# ----------------------------------------------------------------------------- clipped_surrogate


def _ratios(values):
    # logprobs with old_logprobs = 0, so exp(logp - old) = the ratio itself
    return torch.log(torch.tensor([values])), torch.zeros(1, len(values))


def test_clipped_surrogate_crafted_ratios():
    # eps = 0.2, clip range [0.8, 1.2]; loss = -min(r A, clip(r) A)
    #   r 1.5, A +1: -min(1.5, 1.2)   = -1.2, clipped
    #   r 0.5, A +1: -min(0.5, 0.8)   = -0.5, not clipped
    #   r 0.5, A -1: -min(-0.5, -0.8) =  0.8, clipped
    #   r 1.5, A -1: -min(-1.5, -1.2) =  1.5, not clipped
    logp, old = _ratios([1.5, 0.5, 0.5, 1.5])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = clipped_surrogate(logp, old, adv, epsilon=0.2)
    assert_close(loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5]]))
    assert torch.equal(clipped, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))


def test_clipped_surrogate_epsilon_high_moves_upper_clip_only():
    # eps = 0.2, eps_high = 0.28: clip range [0.8, 1.28]
    #   r 1.5, A +1: -min(1.5, 1.28)  = -1.28, clipped (was -1.2)
    #   r 0.5, A -1: -min(-.5, -.8)   =  0.8,  clipped (lower clip unchanged)
    #   r 1.25, A +1: inside [0.8, 1.28] -> -1.25, not clipped (would be clipped to -1.2 with eps_high = 0.2)
    logp, old = _ratios([1.5, 0.5, 1.25])
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, clipped = clipped_surrogate(logp, old, adv, epsilon=0.2, epsilon_high=0.28)
    assert_close(loss, torch.tensor([[-1.28, 0.8, -1.25]]))
    assert torch.equal(clipped, torch.tensor([[1.0, 1.0, 0.0]]))
    loss_sym, clipped_sym = clipped_surrogate(logp, old, adv, epsilon=0.2)
    assert_close(loss_sym, torch.tensor([[-1.2, 0.8, -1.2]]))
    assert torch.equal(clipped_sym, torch.tensor([[1.0, 1.0, 1.0]]))


def test_clipped_surrogate_per_sequence_advantages_broadcast():
    # A per sequence [B] = [2, -1] is the same as per token [[2, 2], [-1, -1]]; ratio 1 -> loss = -A
    logp = torch.zeros(2, 2)
    loss, clipped = clipped_surrogate(logp, logp, torch.tensor([2.0, -1.0]), epsilon=0.2)
    assert_close(loss, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))
    assert torch.equal(clipped, torch.zeros(2, 2))


def test_clipped_surrogate_on_policy_gradient_is_reinforce():
    # old = logp.detach(): ratio = 1, d(-ratio A)/d logp = -A at every token
    logp = torch.tensor([[-0.3, -1.2], [-2.0, -0.1]], requires_grad=True)
    adv = torch.tensor([2.0, -3.0])
    loss, _ = clipped_surrogate(logp, logp.detach(), adv, epsilon=0.2)
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-2.0, -2.0], [3.0, 3.0]]))


# ----------------------------------------------------------------------------- aggregate_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
# grpo:    ((1 + 2 + 3)/3 + 4/1) / 2 = (2 + 4) / 2 = 3
# dr_grpo: (6 + 4) / (2 sequences * 4 max tokens) = 1.25
# dapo:    (6 + 4) / 4 scored tokens = 2.5
AGGREGATED = {"grpo": 3.0, "dr_grpo": 1.25, "dapo": 2.5}


@pytest.mark.parametrize("aggregation", ["grpo", "dr_grpo", "dapo"])
def test_aggregate_loss_hand_values(aggregation):
    got = aggregate_loss(LOSS, MASK, aggregation, num_sequences=2, num_tokens=4, max_completion_length=4)
    assert got.item() == pytest.approx(AGGREGATED[aggregation])


@pytest.mark.parametrize("aggregation", ["grpo", "dr_grpo", "dapo"])
def test_aggregate_loss_micro_batches_sum_to_batch_loss(aggregation):
    # one sequence per micro-batch, normalised by the whole batch (2 sequences, 4 tokens):
    #   grpo 2/2 + 4/2 = 3;  dr_grpo 6/8 + 4/8 = 1.25;  dapo 6/4 + 4/4 = 2.5
    parts = [
        aggregate_loss(
            LOSS[i : i + 1],
            MASK[i : i + 1],
            aggregation,
            num_sequences=2,
            num_tokens=4,
            max_completion_length=4,
        )
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(AGGREGATED[aggregation])


def test_aggregate_loss_masked_tokens_do_not_count():
    # a large loss on a masked token changes nothing
    loss = LOSS.clone()
    loss[1, 3] = 1000.0
    for aggregation, value in AGGREGATED.items():
        got = aggregate_loss(loss, MASK, aggregation, num_sequences=2, num_tokens=4, max_completion_length=4)
        assert got.item() == pytest.approx(value)


def test_aggregate_loss_unknown_aggregation():
    with pytest.raises(ValueError, match="aggregate_loss: unknown aggregation 'mean'"):
        aggregate_loss(LOSS, MASK, "mean", num_sequences=2, num_tokens=4, max_completion_length=4)


# ----------------------------------------------------------------------------- discounted_returns


def test_discounted_returns():
    # gamma 0.5: G_2 = 2; G_1 = 0 + .5 * 2 = 1; G_0 = 1 + .5 * 1 = 1.5
    assert_close(discounted_returns(torch.tensor([1.0, 0.0, 2.0]), 0.5), torch.tensor([1.5, 1.0, 2.0]))
    # along the last dimension of a batch; gamma 1 = plain suffix sums: [3, 2] -> [5, 2]
    got = discounted_returns(torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 2.0]]), 1.0)
    assert_close(got, torch.tensor([[3.0, 2.0, 2.0], [5.0, 5.0, 2.0]]))


# ----------------------------------------------------------------------------- joint_action_indices


def test_joint_action_indices_aligned():
    assert joint_action_indices(3, 2, "aligned").tolist() == [[0, 0], [1, 1], [2, 2]]


def test_joint_action_indices_cross_every_combination():
    assert joint_action_indices(2, 2, "cross").tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    # max_joint_actions >= G^N changes nothing
    assert joint_action_indices(2, 2, "cross", max_joint_actions=10).tolist() == [
        [0, 0],
        [0, 1],
        [1, 0],
        [1, 1],
    ]


def test_joint_action_indices_cross_sampled_subset():
    rows = joint_action_indices(
        3, 2, "cross", max_joint_actions=5, generator=torch.Generator().manual_seed(0)
    )
    assert rows.shape == (5, 2)
    as_tuples = [tuple(r) for r in rows.tolist()]
    assert len(set(as_tuples)) == 5  # distinct joint actions
    assert {(0, 0), (1, 1), (2, 2)} <= set(as_tuples)  # the aligned ones are always there
    for agent in range(2):
        assert set(rows[:, agent].tolist()) == {0, 1, 2}  # every completion of every agent is credited
    assert all(0 <= i < 3 for row in as_tuples for i in row)

    again = joint_action_indices(
        3, 2, "cross", max_joint_actions=5, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(rows, again)  # deterministic for a seeded generator
    # and actually random: over 20 seeds the 2 extra rows (out of C(6, 2) = 15 choices) are not always the same
    draws = {
        tuple(map(tuple, joint_action_indices(3, 2, "cross", 5, torch.Generator().manual_seed(s)).tolist()))
        for s in range(20)
    }
    assert len(draws) > 1


def test_joint_action_indices_cross_sampled_subset_of_a_huge_space():
    # G = 17, N = 4: 83521 > 2^16 combinations -> rejection sampling; 17 aligned + 3 others
    rows = joint_action_indices(
        17, 4, "cross", max_joint_actions=20, generator=torch.Generator().manual_seed(1)
    )
    as_tuples = [tuple(r) for r in rows.tolist()]
    assert len(as_tuples) == len(set(as_tuples)) == 20
    assert {(j, j, j, j) for j in range(17)} <= set(as_tuples)


def test_joint_action_indices_single_agent_is_aligned():
    assert joint_action_indices(3, 1, "cross").tolist() == [[0], [1], [2]]
    assert joint_action_indices(3, 1, "aligned").tolist() == [[0], [1], [2]]


def test_joint_action_indices_unknown_mode():
    with pytest.raises(ValueError, match="joint_action_indices: unknown mode 'diagonal'"):
        joint_action_indices(2, 2, "diagonal")


def test_turn_scale_uses_the_spread_of_each_turn():
    # Groups 0 and 1 are at turn 0, group 2 at turn 1 (G = 2), baseline group_mean:
    #   turn 0 returns {0, 2, 4, 6}: unbiased std = sqrt(20/3); turn 1 returns {1, 3}: std = sqrt(2)
    #   A = R - group mean = [[-1, 1], [-1, 1], [-1, 1]]
    returns = torch.tensor([[0.0, 2.0], [4.0, 6.0], [1.0, 3.0]])
    got = group_advantages(returns, "group_mean", "turn", turns=torch.tensor([0, 0, 1]))
    s0, s1 = math.sqrt(20 / 3) + 1e-4, math.sqrt(2) + 1e-4
    assert_close(got, torch.tensor([[-1 / s0, 1 / s0], [-1 / s0, 1 / s0], [-1 / s1, 1 / s1]]))
    with pytest.raises(ValueError, match=r"scale='turn' needs turns of shape \[num_groups\]"):
        group_advantages(returns, "group_mean", "turn")


def test_masked_positions_add_exactly_nothing():
    # An overflowing loss after EOS (inf) must not become inf * 0 = NaN; a -inf logit adds 0 entropy.
    loss = aggregate_loss(torch.tensor([[1.0, float("inf")]]), torch.tensor([[1, 0]]), "dapo", 1, 1, 2)
    assert loss.item() == 1.0
    logits = torch.tensor([[0.0, float("-inf"), 1.0]], requires_grad=True)
    with_masked = token_entropy(logits)
    assert torch.allclose(with_masked, token_entropy(torch.tensor([[0.0, 1.0]])))  # 0.5822 nats, not NaN
    with_masked.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # ... nor NaN in the gradient: exp(ref - logp) = exp(115) overflows after EOS, where the mask removes it
    # before the exponential (a product or where after it would give 0 x inf = NaN in the backward).
    logp = torch.tensor([[-1.0, -120.0]], requires_grad=True)
    mask = torch.tensor([[1, 0]])
    per_token, _ = clipped_surrogate(logp, torch.tensor([[-1.0, 0.0]]), torch.tensor([1.0]), 0.2, mask=mask)
    per_token = per_token + 0.05 * kl_k3(logp, torch.tensor([[-1.2, -5.0]]), mask)
    aggregate_loss(per_token, mask, "dapo", 1, 1, 2).backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0


def test_completion_lengths_reach_each_rows_last_scored_token():
    """1 + the last position of each row's mask: a prefix, a gap before the last token, none, the whole width."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert completion_lengths(mask).tolist() == [2, 3, 0, 4]
    assert completion_lengths(mask.bool()).tolist() == [2, 3, 0, 4]


def test_to_width_zeroes_past_each_rows_end_and_pads_to_the_width():
    """Two rows run for 3 positions of a 5-wide batch, ending after 2 and 3: [[1, 2, 0, 0, 0], [4, 5, 6, 0, 0]]."""
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    got = to_width(per_token, torch.tensor([2, 3]), 5)
    assert got.tolist() == [[1.0, 2.0, 0.0, 0.0, 0.0], [4.0, 5.0, 6.0, 0.0, 0.0]]
