"""Hand-computed checks of formulas that mutation testing found unpinned by the other tests.

Each test names the mutation it kills; every expected number is worked out by hand in the comments.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from comarl.algorithms import aggregate_loss, group_advantages, token_entropy, token_logprobs, whiten
from comarl.engines import Generation, SamplingParams, next_tokens, sampling_scores, seeded_draws, stream_seed
from comarl.rollout import Rollout, tree_returns, with_rewards

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


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_token_logprobs_gradient_is_one_hot_minus_softmax(temperature):
    """d log softmax(x / T)[y] / dx = (onehot(y) - softmax(x / T)) / T (mutation: ``logsumexp`` detached,
    which keeps the values and drops the -softmax part of the gradient, so only a learning run noticed).

    x = [0, ln 2, ln 3] * T, y = 1: softmax(x / T) = [1/6, 2/6, 3/6], so the gradient is
    [-1/6, 4/6, -3/6] / T.
    """
    logits = (torch.tensor([[[0.0, math.log(2.0), math.log(3.0)]]]) * temperature).requires_grad_(True)
    value = token_logprobs(logits, torch.tensor([[1]]), temperature=temperature)
    assert_close(value, torch.tensor([[math.log(2.0 / 6.0)]]))
    value.sum().backward()
    assert_close(logits.grad, torch.tensor([[[-1 / 6, 4 / 6, -3 / 6]]]) / temperature)


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


# ----------------------------------------------------------------------------- sampling_scores: top-k

INF = math.inf


def test_top_k_keeps_the_k_largest_and_their_ties():
    """top_k = 2 on [4, 3, 2, 1]: the 2nd largest is 3, scores < 3 get -inf -> [4, 3, -inf, -inf]
    (mutation ``<=``: the k-th itself dropped -> [4, -inf, -inf, -inf]). Ties at the k-th are kept:
    [3, 3, 3, 1] -> the 2nd largest is 3 -> [3, 3, 3, -inf]. (The transformers comparison in test_engines
    uses top_p = 0.8 after top_k = 20, which already removes the 20th token.)"""
    params = SamplingParams(top_k=2)
    eos = torch.tensor([9])
    got = sampling_scores(torch.tensor([[4.0, 3.0, 2.0, 1.0], [3.0, 3.0, 3.0, 1.0]]), params, eos)
    assert got.tolist() == [[4.0, 3.0, -INF, -INF], [3.0, 3.0, 3.0, -INF]]


def test_top_k_larger_than_the_vocabulary_keeps_every_token():
    """top_k = 5 over V = 3 tokens filters nothing (mutation: ``topk(scores, top_k)`` raises, k out of range)."""
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    assert torch.equal(sampling_scores(logits, SamplingParams(top_k=5), torch.tensor([9])), logits)


# ----------------------------------------------------------------------------- sampling_scores: top-p


def test_top_p_drops_a_token_whose_cumulative_probability_equals_one_minus_top_p():
    """Four equal logits: p = 1/4 each (exact), ascending cumsum [.25, .5, .75, 1]; top_p = .75 -> 1 - top_p = .25.
    The rule drops cumsum ``<=`` .25 (as transformers' TopPLogitsWarper does): exactly one token goes, three stay
    (mutation ``<``: none dropped)."""
    got = sampling_scores(torch.zeros(1, 4), SamplingParams(top_p=0.75), torch.tensor([9]))
    assert int(torch.isinf(got).sum()) == 1 and int((got == 0).sum()) == 3


def test_a_tiny_top_p_still_keeps_the_most_likely_token():
    """top_p = 5e-8: 1 - top_p rounds to 0.99999994 in float32, and a float32 CDF can end there (softmax of
    [0, 2] sorted ascending sums to 0.99999994, not 1). Then every token is ``<=`` the threshold, yet the last
    (most likely) one always survives -> [-inf, 2] (mutation without ``drop[:, -1] = False``: every score -inf,
    softmax NaN)."""
    torch.manual_seed(0)
    logits = torch.cat([torch.tensor([[0.0, 2.0]]), torch.randn(63, 2) * 3])
    ascending = torch.sort(logits, dim=-1).values
    assert (ascending.softmax(dim=-1).cumsum(dim=-1)[:, -1] <= 1 - 5e-8).any()  # the rounding the rule guards
    got = sampling_scores(logits, SamplingParams(top_p=5e-8), torch.tensor([9]))
    kept = torch.isfinite(got)
    assert (kept.sum(dim=1) == 1).all()
    assert torch.equal(kept.float().argmax(dim=1), logits.argmax(dim=1))


# ----------------------------------------------------------------------------- seeded_draws


def test_seeded_draws_each_prompt_from_its_own_seed_alone():
    """Rows b * G .. b * G + G - 1 are the first G * T values of a stream seeded with seeds[b] alone, whatever
    the other prompts and G are (mutation: one stream, seeded with seeds[0], shared by every prompt in turn ->
    prompt 1's rows would continue prompt 0's stream). test_engines only checks prompt 0 of a call."""
    G, T = 2, 3
    draws = seeded_draws([11, 7], G, T, "cpu")
    assert draws.shape == (4, 3)
    assert torch.equal(draws[:2], torch.rand(G, T, generator=torch.Generator().manual_seed(11)))
    assert torch.equal(draws[2:], torch.rand(G, T, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(draws[2:], seeded_draws([7], G, T, "cpu"))  # alone: the same rows
    assert torch.equal(seeded_draws([5, 7], 3, T, "cpu")[3:5], draws[2:])  # G = 3: samples 0 and 1 unchanged


# ----------------------------------------------------------------------------- stream_seed


def test_stream_seed_is_pinned_and_depends_on_the_order_of_its_keys():
    """The seeds must be the same in every process, Python version and release, so the values are pinned:
    blake2b(b"(0, 1)", digest_size=8) = ed c7 5a 66 72 fd 4b fa; read little-endian that is 0xfa4bfd72665ac7ed
    = 18035787800520607725, halved (>> 1) into [0, 2**63): 9017893900260303862.
    (Mutations: big-endian -> 8566881351708354045; sorting the keys -> stream_seed(1, 0) == stream_seed(0, 1),
    so item 0 of seed 1 would replay item 1 of seed 0.)"""
    assert stream_seed(0, 1) == 9017893900260303862
    assert stream_seed(1, 0) == 6882986155843456424
    assert stream_seed(42) == 7957963407444518553
    assert stream_seed(2024, 3, 7) == 4471965803987765567
    assert all(0 <= stream_seed(*k) < 2**63 for k in [(0,), (1, 2), (7, 7, 7)])


# ----------------------------------------------------------------------------- tree returns, backup='max'

# Two agents, G = 2, aligned joint actions (joint action k = completion k of each agent), gamma = 0.5.
# Root (node 0): joint action 0 -> node 1, joint action 1 ends the episode. Node 1 is the last turn.
#   rewards[node, k, agent]:  node 0: k0 [0, 0], k1 [1, 1];  node 1: k0 [1, 4], k1 [3, 2]
# backup='max' is per agent: V(node 1) = [max(1, 3), max(4, 2)] = [3, 4] -> root k0 = [0 + .5 * 3, 0 + .5 * 4]
# = [1.5, 2]. (backup='mean': V = [2, 3] -> [1, 1.5]; a max over agents too: V = [4, 4] -> [2, 2].)
TWO_AGENT_REWARDS = torch.tensor([[[0.0, 0.0], [1.0, 1.0]], [[1.0, 4.0], [3.0, 2.0]]])
TWO_AGENT_DONE = torch.tensor([[False, True], [True, True]])


def test_max_backup_takes_each_agents_own_best_joint_action():
    got = tree_returns(TWO_AGENT_REWARDS, TWO_AGENT_DONE, {0: {0: 1}}, discount=0.5, backup="max")
    assert got[0].tolist() == [[1.5, 2.0], [1.0, 1.0]]
    assert torch.equal(got[1], TWO_AGENT_REWARDS[1])  # last turn: R = r
    mean = tree_returns(TWO_AGENT_REWARDS, TWO_AGENT_DONE, {0: {0: 1}}, discount=0.5, backup="mean")
    assert mean[0, 0].tolist() == [1.0, 1.5]


def _two_node_rollout():
    def generation():
        ids = torch.zeros(4, 1, dtype=torch.long)  # 2 nodes x G = 2 completions
        return Generation(ids, torch.ones(4, 1), ids, torch.ones(4, 1), ["p"] * 4, ["c"] * 4)

    joint = torch.tensor([[[0, 0], [1, 1]], [[0, 0], [1, 1]]])
    zeros = torch.zeros(2, 2, 2)
    return Rollout(
        generations=[generation(), generation()],
        joint_index=joint,
        rewards=zeros,
        returns=[torch.zeros(2, 2), torch.zeros(2, 2)],
        node_returns=zeros,
        depth=torch.tensor([0, 1]),
        terminal=torch.tensor([[False, True], [True, True]]),
        child=torch.tensor([[1, -1], [-1, -1]]),
        done=TWO_AGENT_DONE,
        success=None,
    )


def test_with_rewards_recomputes_the_returns_with_the_trees_backup():
    """kl_penalty='reward' recomputes the returns through ``with_rewards(..., backup=tree_backup)``: with 'max'
    the root's joint action 0 returns [1.5, 2] (see above), not the 'mean' [1, 1.5] (mutation: backup dropped).
    Completion k of each agent is in joint action k alone: agent 0's returns at the root are [1.5, 1], agent 1's
    [2, 1]; at node 1 they are its rewards, [1, 3] and [4, 2]."""
    got = with_rewards(_two_node_rollout(), TWO_AGENT_REWARDS, discount=0.5, backup="max")
    assert got.node_returns[0].tolist() == [[1.5, 2.0], [1.0, 1.0]]
    assert [r.tolist() for r in got.returns] == [[[1.5, 1.0], [1.0, 3.0]], [[2.0, 1.0], [4.0, 2.0]]]
    assert torch.equal(got.rewards, TWO_AGENT_REWARDS)
    mean = with_rewards(_two_node_rollout(), TWO_AGENT_REWARDS, discount=0.5)
    assert mean.node_returns[0, 0].tolist() == [1.0, 1.5]
