"""The math of policy-gradient MARL for LLMs, as pure functions on tensors.

Nothing here touches models, files or configs: every function takes tensors and
returns tensors, so each formula can be checked by hand (see tests/test_algorithms.py).

Shapes: ``B`` sequences, ``T`` completion tokens (right-padded), ``V`` vocabulary,
``G`` samples per group (``num_generations``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from comarl.choices import AGGREGATIONS, BASELINES, CENTRED_BASELINES, PAIR_SELECTIONS, SCALES


def group_advantages(
    returns: torch.Tensor,
    baseline: str = "group_mean",
    scale: str = "group",
    greedy_returns: torch.Tensor | None = None,
    eps: float = 1e-4,
    turns: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages of ``returns`` shaped ``[num_groups, G]`` (one group = the G samples of one prompt).

    Baselines ``b`` (per group):

    - ``group_mean``    b = mean_j R_j                               (MAGRPO / GRPO)
    - ``none``          b = 0                                        (MAREINFORCE)
    - ``leave_one_out`` b_i = (sum_j R_j - R_i) / (G - 1)            (MARLOO / RLOO)
    - ``group_max``     b = max_j R_j
    - ``greedy``        b = R(greedy joint action of the group), given as ``greedy_returns[num_groups]``
                                                                     (MAReMax, as in the ReMax paper)

    Then ``A = R - b`` is divided by a scale:

    - ``group``  A / (std_j R_j + eps)    std over the G samples of the group (unbiased, as in GRPO)
    - ``batch``  A / (std R + eps)        std over every return in the batch
    - ``turn``   A / (std R_turn + eps)   std over the returns of every group at the same turn
                                          (``turns[num_groups]`` gives each group's turn)
    - ``none``   A

    The scale divides by the spread of the *returns*, not of ``A``, so the baselines stay
    different under every scale: leave-one-out is ``G/(G-1)`` times the group-mean advantage.
    (Re-standardising ``A`` itself, as CoMLRL does by default, would make all four estimators
    identical.) Only a centred baseline (``group_mean``, ``leave_one_out``, ``group_max``) may be
    scaled: its ``A`` shrinks with the spread, while ``R - b`` of ``none`` or ``greedy`` does not, and
    a group whose returns are all equal would get ``A = (R - b) / eps``, about 1e4 (ValueError).

    A group whose returns are all equal teaches nothing: with a centred baseline its advantages are
    exactly 0 (its mean can round to a neighbour of the returns, which eps would then magnify).
    """
    if returns.dim() != 2:
        raise ValueError(
            f"group_advantages: returns must be [num_groups, G], got shape {tuple(returns.shape)}"
        )
    G = returns.shape[1]
    if baseline == "group_mean":
        b = returns.mean(dim=1, keepdim=True)
    elif baseline == "none":
        b = torch.zeros_like(returns[:, :1])
    elif baseline == "leave_one_out":
        if G < 2:
            raise ValueError("group_advantages: baseline='leave_one_out' needs num_generations >= 2")
        b = (returns.sum(dim=1, keepdim=True) - returns) / (G - 1)
    elif baseline == "group_max":
        b = returns.max(dim=1, keepdim=True).values
    elif baseline == "greedy":
        if greedy_returns is None or greedy_returns.shape != returns.shape[:1]:
            raise ValueError("group_advantages: baseline='greedy' needs greedy_returns of shape [num_groups]")
        b = greedy_returns.unsqueeze(1)
    else:
        raise ValueError(f"group_advantages: unknown baseline {baseline!r}; choose one of {BASELINES}")
    advantages = returns - b
    if baseline in CENTRED_BASELINES:
        flat = returns.amax(dim=1, keepdim=True) == returns.amin(dim=1, keepdim=True)
        advantages = advantages.masked_fill(flat, 0.0)
    elif scale != "none" and scale in SCALES:
        raise ValueError(
            f"group_advantages: scale={scale!r} with baseline={baseline!r} divides uncentred advantages by the "
            f"spread of the returns; scale only a centred baseline {CENTRED_BASELINES}, or use scale='none'"
        )
    if scale == "group":
        if G < 2:
            raise ValueError("group_advantages: scale='group' needs num_generations >= 2")
        advantages = advantages / (returns.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        if returns.numel() < 2:
            raise ValueError("group_advantages: scale='batch' needs at least 2 returns in the batch")
        advantages = advantages / (returns.std() + eps)
    elif scale == "turn":
        if turns is None or turns.shape != returns.shape[:1]:
            raise ValueError("group_advantages: scale='turn' needs turns of shape [num_groups]")
        std = torch.empty_like(returns[:, :1])
        for t in turns.unique():
            rows = turns == t
            std[rows] = returns[rows].std() if returns[rows].numel() > 1 else 0.0
        advantages = advantages / (std + eps)
    elif scale != "none":
        raise ValueError(f"group_advantages: unknown scale {scale!r}; choose one of {SCALES}")
    return advantages


def cross_returns(
    joint_rewards: torch.Tensor, joint_index: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """Per-completion returns of one agent from the rewards of the joint actions that contain it.

    ``joint_rewards[K]`` are the rewards of K joint actions of one group; ``joint_index[K]`` is the
    index (0..G-1) of this agent's completion in each joint action. Completion ``j`` gets

        R_j = mean_{k : joint_index[k] = j} r_k

    i.e. its expected team reward when its partners' completions are drawn from the sampled set.
    (A sum, as CoMLRL uses, would scale with how often j was sampled.) Every completion must
    appear in at least one joint action.

    The mean is taken in float64: a sampled subset credits completions unequally often, and in float32
    ``(r + r + r) / 3`` can differ from ``r`` by an ulp, so a group whose joint actions all scored the same
    would not be flat (``group_advantages`` would scale that ulp up instead of giving exactly 0).
    """
    wide = joint_rewards.to(torch.float64)
    totals = wide.new_zeros(num_generations).index_add_(0, joint_index, wide)
    counts = torch.bincount(joint_index, minlength=num_generations)
    if (counts == 0).any():
        missing = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(f"cross_returns: completions {missing} appear in no joint action")
    return (totals / counts.to(torch.float64)).to(joint_rewards.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities ``log softmax(logits / temperature)[tokens]`` for each position.

    ``logits[B, T, V]`` must already be aligned so that ``logits[:, t]`` predicts ``tokens[:, t]``.
    Dividing by the sampling temperature makes these the log-probs of the distribution the
    tokens were actually sampled from.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # log_softmax(x)[y] = x[y] - logsumexp(x): gather first, never materialise [B, T, V] log-probs twice.
    picked = torch.gather(logits, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def completion_lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's positions up to and including its last scored token, ``1 + max{t : mask[b, t] = 1}``
    (0 for a row with none). Later positions reach no log-prob that is read and, attention being causal, no earlier
    one, so forwards over the completions stop there."""
    T = completion_mask.shape[1]
    return (completion_mask * torch.arange(1, T + 1, device=completion_mask.device)).amax(dim=1)


def to_width(per_token: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``per_token[B, T]`` of a forward that ran ``T <= width`` completion positions, as ``[B, width]`` with 0 at every
    position ``t >= lengths[b]`` (:func:`completion_lengths`: the positions past a row's end)."""
    ended = torch.arange(per_token.shape[1], device=per_token.device) >= lengths[:, None]
    return F.pad(per_token.masked_fill(ended, 0.0), (0, width - per_token.shape[1]))


def truncated_completions(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, eos_token_ids: list[int]
) -> torch.Tensor:
    """``[B]`` bool: True where a completion holds no EOS among its scored tokens.

    ``completion_mask`` is 1 up to and including the first EOS, so a completion the agent ended has an EOS
    under its mask; one without was cut by ``max_new_tokens``. (With ``pad == eos`` the padding after a
    truncated completion is EOS-valued but unscored, so it does not count as an ending.)
    """
    eos = torch.tensor(list(eos_token_ids), device=completion_ids.device)
    return ~(torch.isin(completion_ids, eos) & completion_mask.bool()).any(dim=1)


def kl_k3(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) from samples of pi (Schulman, 2020).

        k3 = exp(ref - logp) - (ref - logp) - 1      (>= 0, unbiased)

    ``ref_logprobs`` come from the frozen reference under ``no_grad``; the gradient flows through
    ``logprobs`` only. Where ``mask`` is 0 (after EOS) k3 is 0 with no gradient: ``ref - logp`` is set
    to 0 before the exponential, which could overflow there (a loss that masks it afterwards still
    gets 0 x inf = NaN in its backward).
    """
    delta = ref_logprobs - logprobs
    if mask is not None:
        delta = torch.where(mask.bool(), delta, 0.0)
    return torch.exp(delta) - delta - 1


def sequence_kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence k1 estimate of KL(pi || pi_ref) from a completion y sampled from pi, ``[B]``:

        KL_seq = sum_t mask_t (logp_t - ref_t)      (log pi(y) - log pi_ref(y); unbiased, can be < 0 per sample)

    This is the KL term that ``kl_penalty='reward'`` subtracts from the reward, ``r - beta * KL_seq``
    (the InstructGPT / PPO-RLHF penalty): the policy gradient then carries it through the advantage,
    so no gradient flows through this function's inputs (both come from ``no_grad`` forwards).
    """
    return ((logprobs - ref_logprobs) * mask).sum(dim=1)


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss and a clipped-token indicator.

        ratio = exp(logp - logp_old)
        loss  = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)

    ``advantages`` is per sequence ``[B]`` (broadcast over tokens) or per token ``[B, T]``.
    With ``old_logprobs = logprobs.detach()`` (a batch used once) the ratio is 1 and the gradient is
    the plain REINFORCE gradient ``-A * grad logp``. Where ``mask`` is 0 (after EOS) the ratio is 1
    with no gradient (as in :func:`kl_k3`, no overflowing exponential there). The second output marks the
    tokens whose gradient the clip removes (``clipped < unclipped``), the ``clip_fraction`` metric.
    """
    if epsilon_high is None:
        epsilon_high = epsilon
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = logprobs - old_logprobs
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages
    loss = -torch.min(unclipped, clipped)
    is_clipped = (clipped < unclipped).float()
    return loss, is_clipped


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    num_sequences: int,
    num_tokens: int,
    max_completion_length: int,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` over a micro-batch that is part of a larger batch.

    The normalisers are those of the *whole* batch (``num_sequences`` sequences holding
    ``num_tokens`` scored tokens), so summing the micro-batch losses gives the batch loss:

    - ``grpo``     (1/S) sum_i (1/|o_i|) sum_t l_it          per-sequence mean, then mean over sequences
    - ``dr_grpo``  (1/(S * L_max)) sum_i sum_t l_it           constant normaliser (Dr. GRPO)
    - ``dapo``     (1/N_tok) sum_i sum_t l_it                 token mean over the batch (DAPO)
    """
    # where, not a product: a position after EOS whose ratio or KL overflowed (inf) must add 0, not inf * 0 = NaN
    masked = torch.where(mask.bool(), per_token_loss, 0.0)
    mask = mask.to(per_token_loss.dtype)
    if aggregation == "grpo":
        lengths = mask.sum(dim=1).clamp(min=1)
        return (masked.sum(dim=1) / lengths).sum() / num_sequences
    if aggregation == "dr_grpo":
        return masked.sum() / (num_sequences * max_completion_length)
    if aggregation == "dapo":
        return masked.sum() / max(num_tokens, 1)
    raise ValueError(f"aggregate_loss: unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")


def discounted_returns(rewards: torch.Tensor, discount: float) -> torch.Tensor:
    """Returns ``G_t = r_t + gamma * G_{t+1}`` along the last dimension (turns).

    ``rewards[..., T]``; the return after the last turn is 0.
    """
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        running = rewards[..., t] + discount * running
        returns[..., t] = running
    return returns


# ----------------------------------------------------------------------------- critics (IAC, MAAC, IPPO, MAPPO)


def tree_lambda_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    child: torch.Tensor,
    done: torch.Tensor,
    discount: float,
    lam: float,
) -> torch.Tensor:
    """TD(lambda) returns of every joint action of a rollout tree, ``[num_nodes, K, N]``.

    ``rewards[n, k, i]``: agent i's reward for joint action k at node n; ``values[n, i]``: the critic's
    value of node n's state for agent i; ``child[n, k]``: the node that joint action leads to (-1: none);
    ``done[n, k]``: the episode ended there. Children have larger indices than their parents. With
    ``c = child[n, k]``::

        G[n, k] = r[n, k] + gamma * ((1 - lambda) * V[c] + lambda * mean_k' G[c, k'])

    and ``G[n, k] = r[n, k]`` when the episode is done or the turn limit is reached. A joint action that
    could go on but got no child (the ``max_children`` budget) uses the mean of its expanded siblings'
    ``V[c]`` and ``mean_k' G[c, k']``. On a chain (K = 1) this is the GAE recursion over turns::

        A[t] = G[t] - V[t] = delta[t] + gamma * lambda * A[t + 1],   delta[t] = r[t] + gamma * V[t + 1] - V[t]

    ``lambda = 1`` gives Monte-Carlo returns (the critic is only a baseline); ``lambda = 0`` gives
    one-step TD targets ``r + gamma * V[c]`` (the critic bootstraps).
    """
    num_nodes, K, _ = rewards.shape
    returns = rewards.clone().float()
    mean_return = torch.zeros_like(values, dtype=torch.float32)  # mean_k G[n, k], per agent
    for n in range(num_nodes - 1, -1, -1):
        kids = child[n]
        expanded = kids >= 0
        if expanded.any():
            cs = kids[expanded]
            continuation = (1 - lam) * values[cs] + lam * mean_return[cs]  # [#expanded, N]
            tail = torch.zeros_like(returns[n])
            tail[expanded] = continuation
            pruned = ~expanded & ~done[n]
            tail[pruned] = continuation.mean(dim=0)
            returns[n] += discount * tail
        mean_return[n] = returns[n].mean(dim=0)
    return returns


def counterfactual_baseline(
    q_values: torch.Tensor, joint_index: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """COMA-style baseline from a joint-action critic over the full cross product, ``[K, N]``.

    ``q_values[k, i]`` is Q_i(s, a^k) for every one of the ``K = G^N`` joint actions of one node;
    ``joint_index[k]`` the agents' completion indices in joint action k. Agent i's baseline keeps the
    other agents' answers and averages over its *other* sampled answers::

        b_i(a^k) = 1/(G-1) * sum_{j != a^k_i} Q_i(s, (a^k_{-i}, j))

    It uses only agent i's *other* samples (leave-one-out), drawn independently of ``a^k_i``, so
    ``Q_i(s, a) - b_i`` is an unbiased advantage for agent i (Foerster et al., 2018, with the G samples as the
    counterfactual actions); it equals ``G/(G-1) * (Q_i(s, a) - mean_j Q_i(s, (a^k_{-i}, j)))``.
    """
    K, N = joint_index.shape
    G = num_generations
    if K != G**N:
        raise ValueError(
            f"counterfactual_baseline: needs all G^N = {G**N} joint actions of the node (joint_mode='cross' "
            f"without max_joint_actions), got {K}"
        )
    if G < 2:
        raise ValueError("counterfactual_baseline: needs num_generations >= 2")
    powers = G ** torch.arange(N - 1, -1, -1)
    codes = (joint_index * powers).sum(dim=1)
    position = torch.empty(K, dtype=torch.long)
    position[codes] = torch.arange(K)  # joint action k has code codes[k]
    baseline = torch.empty_like(q_values, dtype=torch.float32)
    for i in range(N):
        others = codes - joint_index[:, i] * powers[i]  # the code with agent i's index set to 0
        every = others.unsqueeze(1) + torch.arange(G).unsqueeze(0) * powers[i]  # [K, G]
        total = q_values[position[every], i].sum(dim=1)
        baseline[:, i] = (total - q_values[:, i]) / (G - 1)
    return baseline


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """Per-sample critic loss, with PPO's value clipping when ``clip`` is set::

    L = 1/2 (V - y)^2                                                  (clip = None)
    L = 1/2 max((V - y)^2, (V_old + clip(V - V_old, -c, c) - y)^2)    (clip = c)
    """
    unclipped = (values - targets) ** 2
    if clip is None:
        return 0.5 * unclipped
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.max(unclipped, (clipped_values - targets) ** 2)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``H = logsumexp(x) - sum_v softmax(x)_v x_v`` of each position's distribution, ``x = logits / T``."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    # A masked-out token (logit -inf, probability 0) adds 0, not 0 * -inf = NaN, in the value and the gradient.
    return torch.logsumexp(logits, dim=-1) - (probs * torch.where(probs > 0, logits, 0.0)).sum(dim=-1)


def whiten(values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean x) / (std x + eps)`` over all elements (PPO's advantage normalisation); all 0 when the values
    are all equal (their mean can round to a neighbour of the values, and eps would magnify that to ~1)."""
    if values.numel() < 2 or bool(values.amax() == values.amin()):
        return torch.zeros_like(values)
    return (values - values.mean()) / (values.std() + eps)


def explained_variance(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """``1 - Var(y - V) / Var(y)``: 1 is a perfect critic, 0 predicts no better than the mean, < 0 worse."""
    var = float(targets.var()) if targets.numel() > 1 else 0.0
    if var == 0:
        return float("nan")
    return 1.0 - float((targets - predictions).var()) / var


# ---------------------------------------------------------------------------- preferences (MADPO, MARLHF)


def preference_pairs(
    rewards: torch.Tensor,
    max_pairs: int | None,
    selection: str = "reward_gap",
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """Preference pairs among the ``K`` candidates of each of ``B`` items: ``[P, 3]`` rows ``(item, chosen, rejected)``.

    ``rewards [B, K]`` are the team rewards of the candidates. Every ordered pair with
    ``r[chosen] > r[rejected]`` is eligible (ties give no preference and are dropped). Per item:
    ``"reward_gap"`` keeps the ``max_pairs`` with the largest gap (ties in the gap: the first in
    ``(chosen, rejected)`` order), ``"random"`` a uniform sample of ``max_pairs`` (from ``generator``, or
    ``generator[b]`` for item b when it is one stream per item), ``"all"`` every eligible pair (``max_pairs``
    ignored). Items come in order; ``max_pairs=None`` keeps all.
    """
    if selection not in PAIR_SELECTIONS:
        raise ValueError(f"preference_pairs: selection={selection!r}, choose one of {list(PAIR_SELECTIONS)}")
    B, K = rewards.shape
    streams = generator if isinstance(generator, Sequence) else [generator] * B
    if len(streams) != B:
        raise ValueError(
            f"preference_pairs: {len(streams)} generators for {B} items; pass one per item, or one"
        )
    chosen, rejected = torch.meshgrid(torch.arange(K), torch.arange(K), indexing="ij")
    chosen, rejected = chosen.flatten(), rejected.flatten()
    rows = []
    for b in range(B):
        r = rewards[b].float()
        gap = r[chosen] - r[rejected]
        keep = (gap > 0).nonzero().flatten()
        if selection == "reward_gap":
            keep = keep[torch.sort(gap[keep], descending=True, stable=True).indices]
        elif selection == "random":
            keep = keep[torch.randperm(keep.numel(), generator=streams[b])]
        if selection != "all" and max_pairs is not None:
            keep = keep[:max_pairs]
        rows.append(torch.stack([torch.full_like(keep, b), chosen[keep], rejected[keep]], dim=1))
    return torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.long)


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi(y | x) = sum_t mask_t log pi(y_t | x, y_<t)`` per sequence, ``[B, T] -> [B]``."""
    return (token_logprobs * mask).sum(dim=-1)


def dpo_margins(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    beta: float,
) -> torch.Tensor:
    """DPO's implicit reward margin per pair::

    m = beta * [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))]

    from sequence log-probs; ``ref_* = None`` is reference-free DPO (``log pi_ref = 0``).
    For a team, the joint policy is the product of the agents' policies, so the team's margin is
    the sum of the agents' margins.
    """
    margin = chosen - rejected
    if ref_chosen is not None:
        margin = margin - (ref_chosen - ref_rejected)
    return beta * margin


def preference_loss(margins: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry negative log-likelihood ``-log sigmoid(m)`` per pair (DPO on margins; a reward model on
    score differences ``m = s_w - s_l``)."""
    return -torch.nn.functional.logsigmoid(margins)
