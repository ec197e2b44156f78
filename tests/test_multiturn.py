"""Multi-turn rollout trees: shapes, call counts, returns by hand, histories, masking, errors. The tests after
"gaps found by mutation testing" each pin a behaviour a mutant of rollout.py once changed unseen."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch

from comarl import ConfigError, FunctionEnv, MAGRPOConfig, MAGRPOTrainer, MAReMaxConfig, MAReMaxTrainer
from comarl.algorithms import tree_lambda_returns
from comarl.engines import Generation, SamplingParams
from comarl.envs import Env, History, StepResult, comlrl_transition
from comarl.rollout import (
    collect,
    episode_answers,
    greedy_returns,
    joint_action_indices,
    tree_returns,
    with_rewards,
)


class CountingEngine:
    """A stand-in for HFEngine: completion j of agent ``name`` is f"{name}s{j}" (whatever the prompt; ``echo``:
    f"{prompt}/{name}s{j}", to tell branches apart); counts calls."""

    def __init__(self, echo: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.echo = echo

    def generate(self, agent, prompts, num_generations, params, seeds=None):
        self.calls.append((agent.name, len(prompts)))
        rows = len(prompts) * num_generations
        texts = [
            f"{p}/{agent.name}s{j}" if self.echo else f"{agent.name}s{j}"
            for p in prompts
            for j in range(num_generations)
        ]
        ones = torch.ones(rows, 2, dtype=torch.long)
        return Generation(ones, ones, ones, ones, [p for p in prompts for _ in range(num_generations)], texts)


def fake_agents(n):
    return [SimpleNamespace(name=f"a{i}", tokenizer=SimpleNamespace(pad_token_id=0)) for i in range(n)]


def env_with(transition, reward=None, num_agents=2, num_turns=3):
    reward = reward or (lambda *completions: [1.0] * len(completions[0]))
    return FunctionEnv(
        reward,
        lambda item: item["prompt"],
        num_agents,
        reward_call="batched",
        transition=transition,
        num_turns=num_turns,
    )


def always_continue(item, completions, history):
    return [f"turn{len(history.responses[0]) + 1}"] * len(completions)


ITEMS = [{"prompt": "p0"}, {"prompt": "p1"}]


@pytest.mark.parametrize(
    ("joint_mode", "max_children", "nodes_per_turn"),
    [
        ("aligned", None, [1, 3, 9]),  # G=3 aligned: K=3 children per node
        ("cross", None, [1, 9, 81]),  # cross: K=G^N=9
        ("cross", 2, [1, 2, 4]),  # budget: 2 children per node
        ("aligned", 1, [1, 1, 1]),  # a single path
    ],
)
def test_tree_shapes_and_batched_calls(joint_mode, max_children, nodes_per_turn):
    engine = CountingEngine()
    rollout = collect(
        env_with(always_continue),
        fake_agents(2),
        ITEMS,
        engine=engine,
        num_generations=3,
        params=[SamplingParams()] * 2,
        joint_mode=joint_mode,
        num_turns=3,
        max_children=max_children,
        generator=torch.Generator().manual_seed(0),
    )
    nodes_per_item = sum(nodes_per_turn)
    assert rollout.depth.numel() == 2 * nodes_per_item
    # one generate per agent per turn, over every node of every item at that depth
    assert engine.calls == [(f"a{i}", 2 * n) for n in nodes_per_turn for i in range(2)]
    assert rollout.generations[0].completion_ids.shape[0] == 2 * nodes_per_item * 3
    assert rollout.returns[1].shape == (2 * nodes_per_item, 3)


def _tree(rollout, node):
    """Node ``node``'s scored joint actions, each with the subtree it leads to (None: not expanded)."""
    return [
        (joint.tolist(), None if int(child) < 0 else _tree(rollout, int(child)))
        for joint, child in zip(rollout.joint_index[node], rollout.child[node])
    ]


def test_a_seeded_item_picks_its_joint_actions_and_branches_alone():
    """With seeds, a node draws the cross joint actions it scores (max_joint_actions) and the branches it expands
    (max_children) from a stream of its own: an item's tree is the same alone or after another item, as it is in
    one process or in a data shard. From the call's shared stream it depends on the items before it."""

    def trees(items, seeds):
        rollout = collect(
            env_with(always_continue),
            fake_agents(2),
            items,
            engine=CountingEngine(),
            num_generations=3,
            params=[SamplingParams()] * 2,
            joint_mode="cross",
            max_joint_actions=5,  # the 3 aligned + 2 of the 6 others
            num_turns=3,
            max_children=2,
            generator=torch.Generator().manual_seed(0),
            seeds=seeds,
        )
        return [_tree(rollout, b) for b in range(len(items))]

    alone = trees(ITEMS[:1], [7])[0]
    assert len(alone) == 5 and sum(child is not None for _, child in alone) == 2
    assert trees([ITEMS[1], ITEMS[0]], [8, 7])[1] == alone
    assert trees(ITEMS[:1], [8])[0] != alone
    assert trees([ITEMS[1], ITEMS[0]], None)[1] != trees(ITEMS[:1], None)[0]


def test_reward_calls_per_turn_batched_and_per_joint_action():
    calls = []

    def reward(a, b):
        calls.append(len(a))
        return [1.0] * len(a)

    collect(
        env_with(always_continue, reward, num_turns=2),
        fake_agents(2),
        ITEMS,
        engine=CountingEngine(),
        num_generations=2,
        params=[SamplingParams()] * 2,
        num_turns=2,
    )
    assert calls == [
        2 * 2,
        2 * 2 * 2,
    ]  # batched: one call per turn; turn 2 has 2 items x 2 nodes x 2 joint actions
    env = FunctionEnv(reward, lambda item: item["prompt"], 2, transition=always_continue, num_turns=2)
    calls.clear()
    collect(
        env,
        fake_agents(2),
        ITEMS,
        engine=CountingEngine(),
        num_generations=2,
        params=[SamplingParams()] * 2,
        num_turns=2,
    )
    assert calls == [1] * (4 + 8)  # per_joint_action: one call per joint action


def test_done_branches_get_no_children_and_the_transition_is_not_called_after_the_last_turn():
    seen = []

    def stop_when_s1(item, completions, history):
        seen.append(len(history.responses[0]))
        return None if completions[0].endswith("s1") else ["again", "again"]

    rollout = collect(
        env_with(stop_when_s1, num_turns=2),
        fake_agents(2),
        ITEMS[:1],
        engine=CountingEngine(),
        num_generations=2,
        params=[SamplingParams()] * 2,
        num_turns=2,
    )
    assert rollout.depth.numel() == 1 + 1  # joint action 1 ended the episode; joint action 0 continued
    assert seen == [1, 1]  # called at turn 1 for both joint actions, never after the turn limit
    assert rollout.terminal.tolist() == [[False, True], [True, True]]


def test_success_counts_episodes_that_ended_not_branches_left_unexpanded():
    """G=4 aligned, max_children=1, 2 turns. Turn 1: sample 0 succeeds and ends, samples 1-3 stay open and one of
    them is expanded; turn 2 (the limit): all 4 succeed. 5 episodes ended, all successes: 1.0. The two open joint
    actions without a child have no outcome (counting them as failures gave 5/7)."""
    from comarl.trainers.magrpo import rollout_metrics

    def reward(a, b, prompts):
        return [float(p == "again" or x.endswith("s0")) for x, p in zip(a, prompts[0])]

    def end_on_s0(item, completions, history):
        return None if completions[0].endswith("s0") else ["again", "again"]

    env = FunctionEnv(
        reward,
        lambda item: item["prompt"],
        2,
        reward_call="batched",
        success_threshold=1.0,
        transition=end_on_s0,
        num_turns=2,
    )
    rollout = collect(
        env,
        fake_agents(2),
        ITEMS[:1],
        engine=CountingEngine(),
        num_generations=4,
        params=[SamplingParams()] * 2,
        num_turns=2,
        max_children=1,
        generator=torch.Generator().manual_seed(0),
    )
    assert rollout.depth.tolist() == [0, 1]
    assert int(rollout.terminal[0].sum()) == 3  # s0 ended, two open joint actions were not expanded
    metrics = rollout_metrics(rollout)
    assert metrics["success"] == 1.0
    assert metrics["solved_turn"] == pytest.approx((1 + 4 * 2) / 5)


class InPlaceTarget(Env):
    """reset changes a dict made in __init__ in place: the items' episodes must not share it."""

    num_agents = 2

    def __init__(self) -> None:
        self.state: dict[str, str] = {}

    def reset(self, item):
        self.state["target"] = item["target"]
        return [item["prompt"]] * 2

    def step(self, joint_action):
        return StepResult([float(joint_action[0] == "a0s0" + self.state["target"])] * 2, done=True)


def test_each_item_keeps_its_own_state_when_reset_changes_it_in_place():
    items = [{"prompt": "p0", "target": ""}, {"prompt": "p1", "target": "x"}]
    rollout = collect(
        InPlaceTarget(),
        fake_agents(2),
        items,
        engine=CountingEngine(),
        num_generations=2,
        params=[SamplingParams()] * 2,
    )
    # item 0's target "" is hit by sample 0; item 1's "x" by none (a shared dict would give both "x": no hit)
    assert rollout.rewards[:, :, 0].tolist() == [[1.0, 0.0], [0.0, 0.0]]


def test_an_env_that_cannot_be_deep_copied_is_told_to_override_fork():
    class WithLock(InPlaceTarget):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()

    with pytest.raises(
        TypeError, match=r"WithLock.fork: the environment cannot be deep-copied .* override fork\(\)"
    ):
        WithLock().fork()


def test_function_env_step_moves_the_episode_on():
    env = env_with(always_continue, num_turns=2)
    assert env.reset({"prompt": "p0"}) == ["p0", "p0"]
    first = env.step(["x", "y"])
    assert (first.done, first.observations, env.history.responses) == (
        False,
        ["turn2", "turn2"],
        [["x"], ["y"]],
    )
    second = env.step(["x2", "y2"])
    assert second.done and env.history.responses == [["x", "x2"], ["y", "y2"]]


def test_turn_metrics_pool_rollouts_whose_episodes_all_ended_at_turn_1():
    """Data shards pool their rollouts' values: a shard whose episodes all ended at turn 1 still counts in
    turn_1/reward (it was left out: the metric then averaged the other shard's turn-1 rewards only)."""
    from comarl.trainers.magrpo import rollout_metrics

    def reward(a, b, prompts):  # 1 for the item that goes on (at both turns), 0 for the other
        return [0.0 if p == "p1" else 1.0 for p in prompts[0]]

    def continues(item, completions, history):
        return ["again", "again"] if item["prompt"] == "p0" else None

    def play(item):
        env = env_with(continues, reward=reward, num_turns=2)
        return collect(
            env,
            fake_agents(2),
            [item],
            engine=CountingEngine(),
            num_generations=2,
            params=[SamplingParams()] * 2,
            num_turns=2,
        )

    long, short = play({"prompt": "p0"}), play({"prompt": "p1"})
    assert int(short.depth.max()) == 0 and int(long.depth.max()) == 1
    parts = [rollout_values_of(long), rollout_values_of(short)]
    shard = type("Shard", (), {"gather": staticmethod(lambda obj: parts)})()
    metrics = rollout_metrics(long, shard)
    assert (
        metrics["turn_1/reward"] == 0.5
    )  # 2 turn-1 joint actions rewarded 1, the short rollout's 2 rewarded 0
    assert metrics["turn_2/reward"] == 1.0


def rollout_values_of(rollout):
    from comarl.trainers.magrpo import rollout_values

    return rollout_values(rollout), rollout.depth


def test_tree_returns_by_hand():
    # Root (node 0) with K=2 joint actions, one agent. Joint action 0 -> child node 1, joint action 1 done.
    # Node 1 rewards [1, 3] (last turn). gamma = 0.5.
    rewards = torch.tensor([[[2.0], [5.0]], [[1.0], [3.0]]])
    done = torch.tensor([[False, True], [True, True]])
    mean = tree_returns(rewards, done, {0: {0: 1}}, discount=0.5, backup="mean")
    # node 1: R = r = [1, 3], V = 2; root: R0 = 2 + 0.5 * 2 = 3, R1 = 5 (done)
    assert mean[:, :, 0].tolist() == [[3.0, 5.0], [1.0, 3.0]]
    best = tree_returns(rewards, done, {0: {0: 1}}, discount=0.5, backup="max")
    assert best[0, 0, 0] == 2 + 0.5 * 3
    # joint action 1 not done but left out of the budget: bootstrapped with its expanded siblings' mean value
    open_ = tree_returns(rewards, torch.tensor([[False, False], [True, True]]), {0: {0: 1}}, discount=0.5)
    assert open_[0, 1, 0] == 5 + 0.5 * 2


def test_discount_reaches_the_completion_returns():
    turn_rewards = {"p0": 1.0, "turn2": 4.0}
    env = FunctionEnv(
        lambda a, b, prompts: [turn_rewards[p] for p in prompts[0]],
        lambda item: item["prompt"],
        2,
        reward_call="batched",
        transition=lambda i, c, h: ["turn2", "turn2"],
        num_turns=2,
    )
    rollout = collect(
        env,
        fake_agents(2),
        ITEMS[:1],
        engine=CountingEngine(),
        num_generations=2,
        params=[SamplingParams()] * 2,
        num_turns=2,
        discount=0.9,
    )
    # root joint actions: 1 + 0.9 * mean(4, 4) = 4.6; turn-2 nodes: 4
    assert torch.allclose(rollout.returns[0][0], torch.tensor([4.6, 4.6]))
    assert torch.allclose(rollout.returns[1][1:], torch.full((2, 2), 4.0))
    # kl_penalty='reward' recomputes the returns from changed rewards down the same tree:
    same = with_rewards(rollout, rollout.rewards, discount=0.9)
    assert all(torch.equal(x, y) for x, y in zip(same.returns, rollout.returns))
    assert torch.equal(same.node_returns, rollout.node_returns)
    # agent 0's reward for joint action 0 of the node after root joint action 0 drops by 1: that node's value
    # for agent 0 becomes mean(3, 4) = 3.5, so the root's joint action 0 returns 1 + 0.9 * 3.5 = 4.15
    changed = rollout.rewards.clone()
    child = int(rollout.child[0, 0])
    changed[child, 0, 0] -= 1
    penalised = with_rewards(rollout, changed, discount=0.9)
    assert torch.allclose(penalised.returns[0][0], torch.tensor([4.15, 4.6]))
    assert torch.allclose(penalised.returns[0][child], torch.tensor([3.0, 4.0]))
    assert torch.equal(penalised.returns[1], rollout.returns[1])  # agent 1's rewards did not change


def test_three_turns_discount_each_later_turn_by_gamma_to_its_distance():
    """R_t = r_t + gamma r_{t+1} + gamma^2 r_{t+2}: the exponent counts turns from the completion's own turn."""
    turn_rewards = {"p0": 1.0, "turn2": 2.0, "turn3": 4.0}
    env = env_with(always_continue, lambda a, b, prompts: [turn_rewards[p] for p in prompts[0]], num_turns=3)
    rollout = collect(
        env, fake_agents(2), ITEMS[:1], engine=CountingEngine(), num_generations=1,
        params=[SamplingParams()] * 2, num_turns=3, discount=0.5,
    )  # fmt: skip
    # a chain of three nodes: 1 + .5 * 2 + .25 * 4 = 3; 2 + .5 * 4 = 4; 4
    assert rollout.depth.tolist() == [0, 1, 2]
    assert [r.flatten().tolist() for r in rollout.returns] == [[3.0, 4.0, 4.0]] * 2
    # TD(lambda) on the same chain: lambda = 1 is these Monte-Carlo returns, lambda = 0 bootstraps r + gamma V(next)
    values = torch.tensor([[10.0, 10.0], [20.0, 20.0], [30.0, 30.0]])
    mc = tree_lambda_returns(rollout.rewards, values, rollout.child, rollout.done, 0.5, 1.0)
    assert torch.equal(mc, rollout.node_returns)
    td = tree_lambda_returns(rollout.rewards, values, rollout.child, rollout.done, 0.5, 0.0)
    # the last turn ends the episode: no V after it
    assert td[:, 0, 0].tolist() == [1 + 0.5 * 20, 2 + 0.5 * 30, 4.0]


def test_cross_tree_returns_with_an_early_done_branch_and_a_pruned_one_by_hand():
    """N = 2, G = 2, joint_mode='cross' (K = 4), two turns, gamma = 0.5, max_children = 2, per-agent rewards.

    Turn 1 (prompt p0): joint action (j0, j1) gives agent 0 ``j0 + j1`` and agent 1 ``2 * j1``; (1, 1) ends the
    episode, the other three go on to prompt ``t{j0}{j1}`` and two of them are expanded. Turn 2 (prompt tXY): agent 0
    gets ``10 X + j0``, agent 1 ``10 Y + j1``, so the node after (X, Y) has value [10 X + .5, 10 Y + .5].
    """

    def reward(a, b, prompts):
        out = []
        for x, y, p in zip(a, b, prompts[0]):
            j0, j1 = int(x[-1]), int(y[-1])
            out.append([j0 + j1, 2.0 * j1] if p == "p0" else [10.0 * int(p[1]) + j0, 10.0 * int(p[2]) + j1])
        return out

    def transition(item, completions, history):
        j0, j1 = (int(c[-1]) for c in completions)
        return None if (j0, j1) == (1, 1) else [f"t{j0}{j1}"] * 2

    env = FunctionEnv(
        reward, lambda item: item["prompt"], 2, reward_call="batched", transition=transition, num_turns=2
    )
    # Root returns R = r + .5 V(child): (0,0) -> [.25, .25], (0,1) -> [1.25, 7.25], (1,0) -> [6.25, .25], (1,1) done
    # -> [2, 2]. The open action left out is bootstrapped with the mean value of its two expanded siblings.
    # Completion j of agent i gets the mean over the joint actions it is in (agent 0's j0 = 0: k = 0, 1 and j0 = 1:
    # k = 2, 3; agent 1's j1 = 0: k = 0, 2 and j1 = 1: k = 1, 3). Siblings' mean V for pruned k = 0: [5.5, 5.5],
    # k = 1: [5.5, .5], k = 2: [.5, 5.5].
    by_pruned = {  # pruned k: (node_returns of the root, agent 0's completion returns, agent 1's)
        0: ([[2.75, 2.75], [1.25, 7.25], [6.25, 0.25], [2.0, 2.0]], [2.0, 4.125], [1.5, 4.625]),
        1: ([[0.25, 0.25], [3.75, 2.25], [6.25, 0.25], [2.0, 2.0]], [2.0, 4.125], [0.25, 2.125]),
        2: ([[0.25, 0.25], [1.25, 7.25], [1.25, 2.75], [2.0, 2.0]], [0.75, 1.625], [1.5, 4.625]),
    }
    seen = set()
    for seed in range(8):
        rollout = collect(
            env, fake_agents(2), ITEMS[:1], engine=CountingEngine(), num_generations=2,
            params=[SamplingParams()] * 2, joint_mode="cross", num_turns=2, max_children=2, discount=0.5,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        assert rollout.joint_index[0].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert rollout.done[0].tolist() == [False, False, False, True]
        pruned = [k for k in range(3) if rollout.child[0, k] < 0]
        assert len(pruned) == 1 and rollout.child[0, 3] == -1
        seen.add(pruned[0])
        root, agent_0, agent_1 = by_pruned[pruned[0]]
        assert rollout.node_returns[0].tolist() == root
        assert (rollout.returns[0][0].tolist(), rollout.returns[1][0].tolist()) == (agent_0, agent_1)
        for child in rollout.child[0][rollout.child[0] >= 0].tolist():  # last turn: R = r
            assert torch.equal(rollout.node_returns[child], rollout.rewards[child])
        # TD(lambda = 1) over the same tree treats the done and the pruned branches alike
        values = torch.zeros(len(rollout.depth), 2)
        assert torch.equal(
            tree_lambda_returns(rollout.rewards, values, rollout.child, rollout.done, 0.5, 1.0),
            rollout.node_returns,
        )
    assert len(seen) > 1  # the budget's pick varies with the generator


def test_greedy_baseline_follows_a_greedy_path_from_every_node():
    """MAReMax over turns: b[n] = sum_s gamma^s r_{t+s} along the team's greedy play from node n."""
    # The reward is the digit at the end of agent 0's prompt: p0 -> 0, p1 -> 1, turn2 -> 2, turn3 -> 3.
    env = env_with(always_continue, lambda a, b, prompts: [float(p[-1]) for p in prompts[0]], num_turns=3)
    engine = CountingEngine()
    common = {"engine": engine, "num_turns": 3, "discount": 0.5}
    rollout = collect(env, fake_agents(2), ITEMS, num_generations=2, params=[SamplingParams()] * 2, **common)
    engine.calls.clear()
    baselines, _ = greedy_returns(
        env, fake_agents(2), rollout, params=[SamplingParams(do_sample=False)] * 2, **common
    )
    # roots: r0 + 0.5 * 2 + 0.25 * 3 (item 0: r0 = 0, item 1: r0 = 1); turn 2: 2 + 0.5 * 3; turn 3: 3
    expected = {0: [1.75, 2.75], 1: [3.5] * 4, 2: [3.0] * 8}
    for depth, values in expected.items():
        got = baselines[rollout.depth == depth]
        assert got.tolist() == [[v, v] for v in values]  # shared reward: the same for both agents
    # one greedy completion per path, all paths batched: 14 nodes, then 6 paths still going, then 2
    assert engine.calls == [(f"a{i}", n) for n in (14, 6, 2) for i in range(2)]


def test_greedy_path_stops_when_the_episode_is_done():
    env = env_with(
        lambda item, completions, history: None if item["prompt"] == "p1" else ["turn2", "turn2"],
        lambda a, b, prompts: [float(p[-1]) for p in prompts[0]],
        num_turns=2,
    )
    common = {"engine": CountingEngine(), "num_turns": 2, "discount": 1.0}
    rollout = collect(env, fake_agents(2), ITEMS, num_generations=1, params=[SamplingParams()] * 2, **common)
    baselines, _ = greedy_returns(
        env, fake_agents(2), rollout, params=[SamplingParams(do_sample=False)] * 2, **common
    )
    # item 0 continues (0 + 2), item 1 is done after turn 1 (1); the turn-2 node of item 0 gets 2
    assert baselines[:, 0].tolist() == [2.0, 1.0, 2.0]


def test_histories_reach_the_transition_intact():
    histories: list[History] = []

    def record(item, completions, history):
        histories.append(history)
        return [f"{item['prompt']}-next-a0", f"{item['prompt']}-next-a1"]

    collect(
        env_with(record, num_turns=3),
        fake_agents(2),
        ITEMS[:1],
        engine=CountingEngine(),
        num_generations=1,
        params=[SamplingParams()] * 2,
        num_turns=3,
    )
    assert histories[0].prompts == [["p0"], ["p0"]] and histories[0].responses == [["a0s0"], ["a1s0"]]
    assert histories[1].prompts == [["p0", "p0-next-a0"], ["p0", "p0-next-a1"]]
    assert histories[1].responses == [["a0s0", "a0s0"], ["a1s0", "a1s0"]]


def test_comlrl_external_transition_plugs_in_unchanged():
    got = {}

    def external_transition(
        prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent
    ):
        got.update(
            prompt=prompt,
            completions=agent_completions,
            n=num_agents,
            prompts=prompt_history_per_agent,
            responses=response_history_per_agent,
        )
        return [f"fix: {c}" for c in agent_completions]

    fmt = [
        lambda ex: f"[helper] {ex['prompt']}",
        lambda ex: f"[main of {ex.get('_original_prompt')}] {ex['prompt']}",
    ]
    transition = comlrl_transition(external_transition, 2, fmt)
    out = transition(
        {"prompt": "task"}, ["x", "y"], History([["[helper] task"], ["[main] task"]], [["x"], ["y"]])
    )
    # formatters re-applied, as CoMLRL does, with the item's own prompt as "_original_prompt"
    assert out == ["[helper] fix: x", "[main of task] fix: y"]
    assert got == {
        "prompt": "task",
        "completions": ["x", "y"],
        "n": 2,
        "prompts": [["[helper] task"], ["[main] task"]],
        "responses": [["x"], ["y"]],
    }
    assert comlrl_transition(external_transition, 2, fmt, prompt_passthrough=True)(
        {"prompt": "task"}, ["x", "y"], History.empty(2)
    ) == ["fix: x", "fix: y"]

    # A formatter that declares external_prompts gets the prompt by that keyword, as CoMLRL calls it
    def own(ex, external_prompts=None):
        return external_prompts if external_prompts is not None else f"Q: {ex['prompt']}"

    assert comlrl_transition(external_transition, 2, [own, fmt[1]])(
        {"prompt": "task"}, ["x", "y"], History.empty(2)
    ) == ["fix: x", "[main of task] fix: y"]


def test_transition_returning_the_wrong_number_of_prompts():
    def one_prompt(item, completions, history):
        return ["only one"]

    with pytest.raises(
        ValueError, match=r"transition 'one_prompt' returned \['only one'\] .* expected a list of 2 prompts"
    ):
        collect(
            env_with(one_prompt, num_turns=2),
            fake_agents(2),
            ITEMS[:1],
            engine=CountingEngine(),
            num_generations=1,
            params=[SamplingParams()] * 2,
            num_turns=2,
        )


def test_environment_text_is_never_trained_on(qwen_bpe):
    """Turn-2 prompts carry environment feedback; only generated tokens are in the completion mask."""
    feedback = "the tests failed : try again"
    args = MAGRPOConfig(
        prompts_per_step=1, num_generations=2, max_new_tokens=3, num_turns=2, max_steps=1, progress_bar=False
    )
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=[{"prompt": "def add(a, b):"}],
        reward_func=lambda a, b: [float(len(a[0]))],
        transition=lambda item, c, h: [f"{feedback} {c[0]}", f"{feedback} {c[1]}"],
        args=args,
    )
    rollout = collect(
        trainer.env,
        trainer.team.agents,
        [{"prompt": "def add(a, b):"}],
        engine=trainer.engine,
        num_generations=2,
        params=trainer._sampling(),
        num_turns=2,
    )
    gen = rollout.generations[0]
    assert gen.completion_ids.shape[0] == (1 + 2) * 2
    assert all(feedback in p for p in gen.prompts[2:])
    feedback_ids = set(trainer.team[0].tokenizer(feedback)["input_ids"])
    scored = set(gen.completion_ids[gen.completion_mask.bool()].tolist())
    prompt_only = feedback_ids - set(trainer.team[0].tokenizer(" ".join(gen.completions))["input_ids"])
    assert not (prompt_only & scored)
    metrics = trainer.train()
    assert "turn_2/reward" in metrics and metrics["nodes_per_item"] == 3


def test_maremax_trains_over_turns(qwen_bpe):
    trainer = MAReMaxTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=[{"prompt": "def add(a, b):"}],
        reward_func=lambda a, b: [float(len(a[0]) > len(b[0]))],
        transition=lambda item, c, h: [f"again {c[1]}", f"again {c[0]}"],
        args=MAReMaxConfig(
            prompts_per_step=1,
            num_generations=2,
            max_new_tokens=3,
            num_turns=2,
            max_steps=1,
            progress_bar=False,
        ),
    )
    metrics = trainer.train()
    assert metrics["nodes_per_item"] == 3 and "turn_2/reward" in metrics
    assert all(math.isfinite(metrics[f"agent_{i}/loss"]) for i in range(2))


def test_multi_turn_needs_a_transition(qwen_bpe):
    with pytest.raises(ConfigError, match="num_turns=2 needs transition="):
        MAGRPOTrainer(
            model=qwen_bpe,
            train_dataset=ITEMS,
            reward_func=lambda a, b: [0.0],
            args=MAGRPOConfig(num_turns=2, prompts_per_step=1),
        )


def test_multi_turn_eval_plays_independent_episodes(qwen_bpe):
    """num_generations_eval=G over turns: G separate paths per item, not a G-ary tree. CoMLRL's eval_logger gets
    every episode's answers turn by turn, and eval_aggregator's keys are returned under eval/."""
    hooks = {}

    def eval_logger(agent_completions_turns, batch_items, prompts):
        hooks.update(answers=agent_completions_turns, items=batch_items, prompts=prompts)
        return [{"turns": len(turns)} for turns in agent_completions_turns[0]]

    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=ITEMS,
        reward_func=lambda a, b: [0.0],
        transition=lambda item, c, h: ["again", "again"],
        args=MAGRPOConfig(
            prompts_per_step=2, num_generations=2, max_new_tokens=2, num_turns=3, progress_bar=False
        ),
        eval_logger=eval_logger,
        eval_aggregator=lambda metrics, num_turns: {"turn_1/episodes": len(metrics), "turns": num_turns},
    )
    calls, generated = [], []
    generate = trainer.engine.generate

    def recording(agent, prompts, num_generations, params, seeds=None):
        calls.append((len(prompts), num_generations))
        generated.append(generate(agent, prompts, num_generations, params, seeds))
        return generated[-1]

    trainer.engine.generate = recording
    result = trainer.evaluate(ITEMS, num_generations=3, do_sample=True)
    assert calls == [(2 * 3, 1)] * (2 * 3)  # 3 turns x 2 agents, each over 2 items x 3 episodes
    assert "eval/turn_3/reward" in result
    # agent i's answer at turn t of episode e is what agent i generated for that episode at turn t
    assert hooks["answers"] == [
        [[generated[2 * t + i].completions[e] for t in range(3)] for e in range(6)] for i in range(2)
    ]
    assert hooks["items"] == [ITEMS[0]] * 3 + [ITEMS[1]] * 3
    assert hooks["prompts"] == [ITEMS[0]["prompt"]] * 3 + [ITEMS[1]["prompt"]] * 3
    assert (result["eval/turn_1/episodes"], result["eval/turns"]) == (6, 3)
    with pytest.raises(ConfigError, match=r"^give eval_logger= and eval_aggregator= together"):
        MAGRPOTrainer(
            model=qwen_bpe, train_dataset=ITEMS, reward_func=lambda a, b: [0.0], eval_logger=eval_logger
        )


def test_environment_and_trainer_turn_limits_must_agree(qwen_bpe):
    env = env_with(always_continue, num_turns=3)
    with pytest.raises(
        ConfigError, match=r"env.num_turns=3 but args.num_turns=1: set the trainer's num_turns"
    ):
        MAGRPOTrainer(model=qwen_bpe, train_dataset=ITEMS, env=env, args=MAGRPOConfig(prompts_per_step=1))


def test_early_termination_ends_episodes_for_success_and_the_greedy_baseline():
    """A node whose team reward passes early_termination_threshold ends its episodes there: they count in
    success (p0 succeeds at turn 1, p1 fails twice: 2 of the 6 ended joint actions), and MAReMax's greedy path
    from that node stops there too. (Turn 2 pays 0 here, so a greedy path that went on would give the same
    baseline: test_the_greedy_path_stops_where_the_team_reward_passes_the_threshold pays turn 2.)"""
    env = FunctionEnv(
        lambda a, b, prompts: [1.0 if p == "p0" else 0.0 for p in prompts[0]],
        lambda item: item["prompt"],
        2,
        reward_call="batched",
        success_threshold=1.0,
        transition=lambda i, c, h: ["again", "again"],
        num_turns=2,
    )
    common = {"engine": CountingEngine(), "num_turns": 2, "discount": 0.9, "early_termination_threshold": 0.5}
    rollout = collect(
        env, fake_agents(2), [{"prompt": "p0"}, {"prompt": "p1"}], num_generations=2, params=[SamplingParams()] * 2,
        **common,
    )  # fmt: skip
    assert rollout.depth.tolist() == [0, 0, 1, 1] and rollout.done[0].tolist() == [True, True]
    values, _ = rollout_values_of(rollout)
    assert values["success"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert values["solved_turn"].tolist() == [1.0, 1.0]
    baseline, _ = greedy_returns(
        env, fake_agents(2), rollout, params=[SamplingParams(do_sample=False)] * 2, **common
    )
    assert baseline[0].tolist() == [
        1.0,
        1.0,
    ]  # p0's greedy play ends with its first reward, as its samples do
    assert baseline[1].tolist() == [0.0, 0.0]


class RecordingProcesses:
    """A stand-in for AgentParallel in one process: generates locally and records what check_same compares."""

    def __init__(self) -> None:
        self.checked: list[tuple[str, object]] = []

    def generate_all(self, engine, agents, prompts, num_generations, params, seeds=None):  # noqa: ANN001, ANN201
        return [engine.generate(a, p, num_generations, sp) for a, p, sp in zip(agents, prompts, params)]

    def check_same(self, what, obj):  # noqa: ANN001, ANN201
        self.checked.append((what, obj))


def test_processes_compare_done_flags_and_next_prompts_not_only_rewards():
    """Under agent_parallel every process steps its own copy of the environment. Two that score alike but
    disagree on whether an episode goes on would play trees of different sizes and pair their collectives
    wrongly (a crash or a hang): what they compare after each turn, and after each greedy step, includes the done
    flags and next prompts."""

    def play(goes_on: bool) -> list:
        env = FunctionEnv(
            lambda a, b, prompts: [1.0] * len(a),
            lambda item: item["prompt"],
            2,
            reward_call="batched",
            transition=(lambda i, c, h: ["again", "again"]) if goes_on else (lambda i, c, h: None),
            num_turns=2,
        )
        processes = RecordingProcesses()
        rollout = collect(
            env, fake_agents(2), ITEMS[:1], engine=CountingEngine(), num_generations=2,
            params=[SamplingParams()] * 2, num_turns=2, parallel=processes,
        )  # fmt: skip
        greedy_returns(
            env, fake_agents(2), rollout, engine=CountingEngine(), params=[SamplingParams(do_sample=False)] * 2,
            num_turns=2, parallel=processes,
        )  # fmt: skip
        return processes.checked

    one, other = play(True), play(False)
    assert [what for what, _ in one[:1]] == ["rewards, done flags or next prompts"]
    assert any(what.startswith("greedy") for what, _ in one)
    assert [r for r, _, _ in one[0][1][0]] == [r for r, _, _ in other[0][1][0]]  # the rewards alone agree
    assert one[0][1] != other[0][1]


class SuccessWhenDone(Env):
    """Two turns; reports info["success"] only on the step that ends the episode (agent 0's sample s0 wins)."""

    num_agents = 2

    def reset(self, item):
        self.turn = 1
        return ["p", "p"]

    def step(self, joint_action):
        hit = joint_action[0].endswith("s0")
        self.turn += 1
        done = hit or self.turn > 2
        info = {"success": hit} if done else {}
        return StepResult([float(hit)] * 2, done, None if done else ["again", "again"], info)


def test_success_is_read_from_the_steps_that_end_episodes():
    """G=2 aligned: s0 wins at turn 1; s1 goes on without a flag, then wins (s0) or fails (s1) at turn 2. The
    success metric was dropped for want of a flag on the turn that went on."""
    common = {"engine": CountingEngine(), "num_generations": 2, "params": [SamplingParams()] * 2}
    rollout = collect(SuccessWhenDone(), fake_agents(2), ITEMS[:1], num_turns=2, **common)
    assert rollout.success[0, 0] == 1.0 and math.isnan(rollout.success[0, 1])  # the open turn has no outcome
    values, _ = rollout_values_of(rollout)
    assert values["success"].tolist() == [1.0, 1.0, 0.0]
    assert values["solved_turn"].tolist() == [1.0, 2.0]
    # cut at the trainer's turn limit without a flag: the episode ended unsolved
    values, _ = rollout_values_of(
        collect(SuccessWhenDone(), fake_agents(2), ITEMS[:1], num_turns=1, **common)
    )
    assert values["success"].tolist() == [1.0, 0.0]


def test_a_wrong_reward_count_on_some_steps_names_the_env_item_and_turn():
    class ThreeOnce(SuccessWhenDone):
        def step(self, joint_action):
            result = super().step(joint_action)
            if self.turn > 2:  # three rewards for two agents, at turn 2
                result.rewards = result.rewards + result.rewards[:1]
            return result

    with pytest.raises(
        ValueError,
        match=r"^ThreeOnce.step returned 3 rewards for 2 agents \(item \{'prompt': 'p0'\}, turn 2\): return one "
        r"reward per agent, or one for the team$",
    ):
        collect(
            ThreeOnce(), fake_agents(2), ITEMS[:1], engine=CountingEngine(), num_generations=2,
            params=[SamplingParams()] * 2, num_turns=2,
        )  # fmt: skip


@pytest.mark.parametrize("joint", [lambda r: r[0], lambda r: r[:1]], ids=["number", "list of one"])
def test_a_joint_reward_is_every_agents(joint):
    """An environment may return the team's reward once (DESIGN: rewards joint or per agent): the rollout gives
    every agent that reward, exactly as if it had been repeated."""

    class Joint(SuccessWhenDone):
        def step(self, joint_action):
            result = super().step(joint_action)
            return StepResult(joint(result.rewards), result.done, result.observations, result.info)

    common = {
        "engine": CountingEngine(),
        "num_generations": 2,
        "params": [SamplingParams()] * 2,
        "num_turns": 2,
    }
    shared = collect(Joint(), fake_agents(2), ITEMS[:1], **common)
    repeated = collect(SuccessWhenDone(), fake_agents(2), ITEMS[:1], **common)
    assert shared.rewards.shape[-1] == 2 and torch.equal(shared.rewards, repeated.rewards)
    assert shared.rewards.sum() > 0  # some joint action won


# ----------------------------------------------------------------------------- gaps found by mutation testing


def sample(completion: str) -> int:
    """The sample index j of a completion ``...s{j}``."""
    return int(completion[-1])


COMMON = {"num_generations": 2, "params": [SamplingParams()] * 2}


def test_a_node_ends_early_only_when_its_mean_team_reward_is_strictly_above_the_threshold():
    """early_termination_threshold = 0.5, G = 2 aligned, two turns, per-agent rewards [agent 0, agent 1] at turn 1:

    - item "eq":   both joint actions [1, 0]   -> team 0.5 each, node mean 0.5: not above 0.5, goes on
      (``>=`` would end it; a sum over agents instead of the mean, 1.0, would end it too);
    - item "mix":  k0 [1, 1], k1 [0, 0]        -> team 1 and 0, node mean 0.5: goes on
      (the best joint action instead of the mean, 1.0, would end it);
    - item "high": both joint actions [1, .5]  -> team 0.75 each, node mean 0.75 > 0.5: ends at turn 1.

    Nodes: 3 roots, then 2 children for each of "eq" and "mix" = 7; "high"'s root joint actions are done.
    """
    turn_1 = {
        "eq": [[1.0, 0.0], [1.0, 0.0]],
        "mix": [[1.0, 1.0], [0.0, 0.0]],
        "high": [[1.0, 0.5], [1.0, 0.5]],
    }

    def reward(a, b, prompts):
        return [turn_1[p][sample(x)] if p in turn_1 else [0.0, 0.0] for x, p in zip(a, prompts[0])]

    env = FunctionEnv(
        reward,
        lambda item: item["prompt"],
        2,
        reward_call="batched",
        transition=lambda item, completions, history: ["again", "again"],
        num_turns=2,
    )
    items = [{"prompt": p} for p in ("eq", "mix", "high")]
    rollout = collect(
        env,
        fake_agents(2),
        items,
        engine=CountingEngine(),
        num_turns=2,
        early_termination_threshold=0.5,
        **COMMON,
    )
    assert rollout.depth.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert rollout.done[:3].tolist() == [[False, False], [False, False], [True, True]]
    assert rollout.child[:3].tolist() == [[3, 4], [5, 6], [-1, -1]]


def test_the_greedy_path_stops_where_the_team_reward_passes_the_threshold():
    """Every turn pays the team 1.0; threshold 0.5, two turns, discount 0.9. The root's team reward 1 passes the
    threshold: its sampled episodes end there (R = 1), and so does its greedy path, b = 1 (going on would give
    1 + 0.9 * 1 = 1.9; tests/test_multiturn.py's early-termination test pays 0 at turn 2, so it cannot tell)."""
    env = FunctionEnv(
        lambda a, b: [1.0] * len(a),
        lambda item: item["prompt"],
        2,
        reward_call="batched",
        transition=lambda item, completions, history: ["again", "again"],
        num_turns=2,
    )
    common = {"engine": CountingEngine(), "num_turns": 2, "discount": 0.9, "early_termination_threshold": 0.5}
    rollout = collect(env, fake_agents(2), [{"prompt": "p0"}], **COMMON, **common)
    assert rollout.depth.tolist() == [0] and rollout.node_returns[0].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    baseline, _ = greedy_returns(
        env, fake_agents(2), rollout, params=[SamplingParams(do_sample=False)] * 2, **common
    )
    assert baseline.tolist() == [[1.0, 1.0]]


class Endless(Env):
    """Never done and no turn limit of its own: the trainer's num_turns alone ends its episodes. Pays 1 a turn."""

    num_agents = 2

    def reset(self, item):
        return ["p", "p"]

    def step(self, joint_action):
        return StepResult([1.0, 1.0], done=False, observations=["again", "again"])


def test_the_greedy_path_stops_at_the_turn_limit_of_an_env_that_never_ends():
    """num_turns = 2, discount 0.5, G = 1. The sampled chain: root (turn 1) -> one node (turn 2), R = [1.5, 1].
    The greedy path from the root plays turns 1 and 2: 1 + 0.5 * 1 = 1.5; from the turn-2 node only turn 2: 1.
    (Playing one turn past the limit would give 1.75 and 1.5. FunctionEnv reports done at its own limit, so
    the other greedy tests cannot tell.)"""
    common = {"engine": CountingEngine(), "num_turns": 2, "discount": 0.5}
    rollout = collect(
        Endless(), fake_agents(2), [{}], num_generations=1, params=[SamplingParams()] * 2, **common
    )
    assert rollout.depth.tolist() == [0, 1]
    assert rollout.node_returns[:, 0, 0].tolist() == [1.5, 1.0]
    baseline, _ = greedy_returns(
        Endless(), fake_agents(2), rollout, params=[SamplingParams(do_sample=False)] * 2, **common
    )
    assert baseline.tolist() == [[1.5, 1.5], [1.0, 1.0]]


def test_success_is_nan_where_a_branch_was_left_without_a_child():
    """Rollout.success is NaN where the episode goes on. G = 4 aligned, max_children = 1, two turns: at the root
    sample 0 succeeds and ends (1.0); samples 1-3 go on, one is expanded and two are left without a child by the
    budget: all three go on, NaN (not 0.0: they were not failures). At turn 2 (the limit) all four succeed.
    (rollout_values recomputes which episodes ended, so the metrics alone cannot see this.)"""

    def reward(a, b, prompts):
        return [float(p == "again" or sample(x) == 0) for x, p in zip(a, prompts[0])]

    env = FunctionEnv(
        reward,
        lambda item: item["prompt"],
        2,
        reward_call="batched",
        success_threshold=1.0,
        transition=lambda item, completions, history: None if sample(completions[0]) == 0 else ["again"] * 2,
        num_turns=2,
    )
    rollout = collect(
        env,
        fake_agents(2),
        [{"prompt": "p0"}],
        engine=CountingEngine(),
        num_generations=4,
        params=[SamplingParams()] * 2,
        num_turns=2,
        max_children=1,
        generator=torch.Generator().manual_seed(0),
    )
    assert rollout.depth.tolist() == [0, 1]
    assert rollout.success[0, 0] == 1.0
    assert all(math.isnan(v) for v in rollout.success[0, 1:].tolist())
    assert rollout.success[1].tolist() == [1.0] * 4


def test_with_rewards_bootstraps_a_branch_left_without_a_child_as_collect_does():
    """G = 2 aligned, max_children = 1, two turns, discount 0.5, shared rewards. Turn 1 pays 1 for both joint
    actions; joint action k goes on to prompt t{k}, whose node pays 4 (t0) or 8 (t1) to both of its joint actions.
    One of the two is expanded; the other is not done, so its return is bootstrapped with the expanded sibling's
    value V: both root joint actions return 1 + 0.5 * V (V = 4: 3.0; V = 8: 5.0). Recomputing from the same rewards
    (kl_penalty='reward') must bootstrap it too, not keep R = 1 (the branch has no child but is not done).
    Less 1 on every turn-2 reward: V drops by 1 and both root returns by 0.5."""
    turn_2 = {"t0": 4.0, "t1": 8.0}

    def reward(a, b, prompts):
        return [turn_2.get(p, 1.0) for p in prompts[0]]

    env = FunctionEnv(
        reward,
        lambda item: item["prompt"],
        2,
        reward_call="batched",
        transition=lambda item, completions, history: [f"t{sample(completions[0])}"] * 2,
        num_turns=2,
    )
    rollout = collect(
        env,
        fake_agents(2),
        [{"prompt": "p0"}],
        engine=CountingEngine(),
        num_turns=2,
        max_children=1,
        discount=0.5,
        generator=torch.Generator().manual_seed(0),
        **COMMON,
    )
    expanded = [k for k in range(2) if rollout.child[0, k] >= 0]
    assert len(expanded) == 1 and not rollout.done[0].any()
    root = 1 + 0.5 * (4.0, 8.0)[expanded[0]]
    assert rollout.node_returns[0].tolist() == [[root, root]] * 2
    same = with_rewards(rollout, rollout.rewards, discount=0.5)
    assert torch.equal(same.node_returns, rollout.node_returns)
    assert all(torch.equal(x, y) for x, y in zip(same.returns, rollout.returns))
    less = rollout.rewards.clone()
    less[1] -= 1
    assert with_rewards(rollout, less, discount=0.5).node_returns[0].tolist() == [[root - 0.5] * 2] * 2


def test_episode_answers_follow_each_root_joint_action_then_the_first_joint_action_of_each_child():
    """G = 2 aligned, two turns, the prompt-echoing engine; the next prompt after joint action (j0, j1) is t{j0}{j1}.
    Episode k takes root joint action k (answers p0/a{i}s{k}), then the first joint action (0, 0) of the node that
    joint action led to (prompt t{k}{k}): answers t{k}{k}/a{i}s0."""
    env = FunctionEnv(
        lambda a, b: [0.0] * len(a),
        lambda item: item["prompt"],
        2,
        reward_call="batched",
        transition=lambda item, completions, history: (
            [f"t{sample(completions[0])}{sample(completions[1])}"] * 2
        ),
        num_turns=2,
    )
    items = [{"prompt": "p0"}]
    rollout = collect(env, fake_agents(2), items, engine=CountingEngine(echo=True), num_turns=2, **COMMON)
    assert episode_answers(rollout, items) == [
        (items[0], [["p0/a0s0", "p0/a1s0"], ["t00/a0s0", "t00/a1s0"]]),
        (items[0], [["p0/a0s1", "p0/a1s1"], ["t11/a0s0", "t11/a1s0"]]),
    ]


def test_max_joint_actions_covering_every_combination_is_the_full_cross_product_without_a_draw():
    """G = 2, N = 2: G^N = 4 joint actions. max_joint_actions = 4 (or more) is every combination, in the order
    max_joint_actions=None lists them, (0,0), (0,1), (1,0), (1,1), and draws nothing from the generator (a seeded
    node's later draws, its max_children pick, stay those of the unbounded setting)."""
    full = [[0, 0], [0, 1], [1, 0], [1, 1]]
    for limit in (None, 4, 5):
        generator = torch.Generator().manual_seed(3)
        assert joint_action_indices(2, 2, "cross", limit, generator).tolist() == full
        assert torch.equal(
            torch.randperm(8, generator=generator),
            torch.randperm(8, generator=torch.Generator().manual_seed(3)),
        )
