"""The self-play and self-improvement examples run end to end on tiny local models."""

from __future__ import annotations

import re

import pytest
import torch

from comarl import ConfigError, MAGRPOConfig, MAGRPOTrainer
from comarl.envs import History
from comarl.tasks import selfimprove, selfplay


def test_hide_and_seek_keeps_score_and_pays_per_agent():
    env = selfplay.HideAndSeek(rounds=2)
    assert env.reset({})[0] == "round 1 . score hider 0 seeker 0 . hide in a place :"
    first = env.step(["park", "park"])  # found
    assert first.rewards == [0.0, 1.0] and not first.done
    assert first.observations[1] == "round 2 . score hider 0 seeker 1 . where is the hider ?"
    second = env.step(["cafe", "park"])  # hidden
    assert second.rewards == [1.0, 0.0] and second.done and second.info["score"] == [1, 1]
    assert env.step(["banana", "park"]).rewards == [0.0, 0.0]  # hiding nowhere scores nothing


def test_hide_and_seek_rounds_are_the_turn_limit_the_trainer_must_use(tmp_path):
    assert selfplay.HideAndSeek(rounds=3).num_turns == 3
    with pytest.raises(
        ConfigError, match=r"env.num_turns=3 but args.num_turns=1: set the trainer's num_turns"
    ):  # it played 1 of the 3 rounds without a word
        MAGRPOTrainer(
            agents=[str(p) for p in selfplay.build_team(tmp_path)],
            train_dataset=selfplay.dataset(),
            env=selfplay.HideAndSeek(rounds=3),
            args=MAGRPOConfig(prompts_per_step=2, num_turns=1),
        )


def test_hide_and_seek_rounds_stay_within_the_tiny_vocabulary():
    words = {word for line in selfplay.corpus() for word in line.split()}
    env = selfplay.HideAndSeek(rounds=selfplay.MAX_ROUNDS)
    observations = env.reset({})
    for _ in range(selfplay.MAX_ROUNDS - 1):  # the hider scores every round: the largest numbers shown
        observations = env.step(["park", "cafe"]).observations
    assert observations[0] == "round 9 . score hider 8 seeker 0 . hide in a place :"
    assert {word for obs in observations for word in obs.split()} <= words  # no <unk> for the tokenizers
    with pytest.raises(ValueError, match=r"HideAndSeek: rounds=10: choose an integer from 1 to 9"):
        selfplay.HideAndSeek(rounds=10)


@pytest.mark.parametrize("rounds", [0, -1, 10, True, 2.0, "3", None])
def test_hide_and_seek_refuses_rounds_that_are_not_an_integer_from_1_to_9(rounds):
    with pytest.raises(
        ValueError, match=rf"^HideAndSeek: rounds={re.escape(repr(rounds))}: choose an integer from 1 to 9 "
    ):
        selfplay.HideAndSeek(rounds=rounds)


def test_hide_and_seek_reset_starts_a_new_game_and_scores_only_real_places():
    env = selfplay.HideAndSeek(rounds=3)
    env.reset({})
    first = env.step(["park", "park"])  # found
    # a place that is not one: neither hidden nor found, even when the seeker names it too
    second = env.step(["banana", "banana"])
    assert second.rewards == [0.0, 0.0] and not second.done
    last = env.step(["cafe", "park"])  # hidden
    assert last.done and last.observations is None  # the game is over: no next round to show
    # each step reports the score after it, kept as it was by the later steps
    assert [r.info["score"] for r in (first, second, last)] == [[0, 1], [0, 1], [1, 1]]
    assert env.reset({}) == [
        "round 1 . score hider 0 seeker 0 . hide in a place :",
        "round 1 . score hider 0 seeker 0 . where is the hider ?",
    ]
    assert env.step(["cafe", "park"]).info["score"] == [1, 0]


def test_self_play_dataset_is_one_item_per_game():
    assert selfplay.dataset() == [{"game": 0}, {"game": 1}, {"game": 2}, {"game": 3}]
    assert selfplay.dataset(2) == [{"game": 0}, {"game": 1}]


def test_self_play_hider_and_seeker_start_as_different_models(tmp_path):
    from safetensors.torch import load_file

    hider, seeker = (load_file(p / "model.safetensors") for p in selfplay.build_team(tmp_path))
    assert hider.keys() == seeker.keys()
    assert any(not torch.equal(hider[name], seeker[name]) for name in hider)


def test_self_play_trains_over_rounds(tmp_path):
    args = MAGRPOConfig(
        prompts_per_step=2,
        num_generations=2,
        num_turns=3,
        max_children=1,
        max_new_tokens=2,
        max_steps=2,
        learning_rate=1e-3,
        progress_bar=False,
    )
    trainer = MAGRPOTrainer(
        agents=[str(p) for p in selfplay.build_team(tmp_path)],
        train_dataset=selfplay.dataset(),
        env=selfplay.HideAndSeek(rounds=3),
        args=args,
    )
    before = [snapshot(agent.model) for agent in trainer.team]
    metrics = trainer.train()
    assert metrics["nodes_per_item"] == 3  # one branch per round: 1 + 1 + 1
    assert {"turn_1/reward", "turn_3/reward", "agent_0/reward", "agent_1/reward"} <= set(metrics)
    # both sides take an optimizer step each training step; the hider, rewarded unevenly, moved (the seeker's
    # two guesses may score alike, an advantage of 0 that leaves its weights as they were)
    assert [int(next(iter(opt.state.values()))["step"]) for opt in trainer.optimizers] == [2, 2]
    assert changed(trainer.team[0].model, before[0])


def test_revise_transition_uses_the_agents_own_previous_answer():
    item = {"city": "lima", "open_places": ["park", "cafe"]}
    history = History([["which place is open in lima ?"]], [["museum ."]])
    assert selfimprove.revise_transition(item, ["museum ."], history) == [
        "you said museum . the museum is closed . the park and the cafe are open . which place is open ?"
    ]
    # at turn 2 the feedback is on the latest answer, not the first
    history = History(
        [["which place is open in lima ?", "you said museum . ..."]], [["museum .", "station ."]]
    )
    assert selfimprove.revise_transition(item, ["station ."], history)[0].startswith("you said station .")
    assert selfimprove.revise_transition(item, ["cafe"], History([[""]], [["cafe"]])) is None


def test_open_place_reward_by_hand():
    completions = ["Park .", "museum", "", "cafe park", "the cafe"]
    open_places = [["park", "cafe"]] * 5
    assert selfimprove.open_place_reward(completions, open_places) == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_revise_transition_reports_an_empty_answer_as_nothing():
    item = {"city": "lima", "open_places": ["park", "cafe"]}
    feedback = selfimprove.revise_transition(item, [" . "], History([[""]], [[" . "]]))
    assert feedback == [
        "you said nothing . the nothing is closed . the park and the cafe are open . which place is open ?"
    ]


def test_self_improvement_corpus_knows_every_prompt():
    words = {word for line in selfimprove.corpus() for word in line.split()}
    for item in selfimprove.dataset():
        assert set(selfimprove.formatter(item).split()) <= words
        for said in (*selfplay.PLACES, ""):
            for prompt in selfimprove.revise_transition(item, [said], History([[""]], [[said]])) or []:
                assert set(prompt.split()) <= words, (item, said)


def test_self_improvement_trains_one_agent_over_turns(tmp_path):
    args = MAGRPOConfig(
        prompts_per_step=3,
        num_generations=2,
        num_turns=2,
        max_new_tokens=2,
        max_steps=2,
        learning_rate=1e-3,
        reward_call="batched",
        success_threshold=1.0,
        progress_bar=False,
    )
    trainer = MAGRPOTrainer(
        model=str(selfimprove.build_agent(tmp_path)),
        num_agents=1,
        train_dataset=selfimprove.dataset(),
        eval_dataset=selfimprove.dataset()[:6],
        reward_func=selfimprove.open_place_reward,
        formatters=selfimprove.formatter,
        transition=selfimprove.revise_transition,
        args=args,
    )
    (before,) = [snapshot(agent.model) for agent in trainer.team]
    metrics = trainer.train()
    assert "turn_1/reward" in metrics and 1 <= metrics["nodes_per_item"] <= 3
    assert changed(trainer.team[0].model, before)
    assert "eval/success" in trainer.evaluate()


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed(model, before) -> bool:
    return any(not torch.equal(p, before[name]) for name, p in model.named_parameters())
