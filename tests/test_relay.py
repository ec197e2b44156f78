"""The two-turn relay game: multi-turn training uses the second turn, single-turn training cannot."""

from __future__ import annotations

import pytest

from comarl import MAGRPOConfig, MAGRPOTrainer
from comarl.envs import FunctionEnv, History
from comarl.tasks import relay
from comarl.tasks.demo import PLACES


def test_relay_transition_ends_on_a_match_and_reports_the_partner():
    item = {"city": "oslo", "open_places": ["park", "cafe"]}
    assert relay.relay_transition(item, ["park", "park ."], History.empty(2)) is None
    assert relay.relay_transition(item, ["park", "museum"], History.empty(2)) == [
        "bob said museum . the park and the cafe are open . where will you meet bob ?",
        "alice said park . where will you meet alice ?",
    ]


def test_relay_views_only_alice_sees_the_open_places():
    item = {"city": "oslo", "open_places": ["park", "cafe"]}
    assert (
        relay.formatter(0)(item)
        == "alice is in oslo . the park and the cafe are open . where will you meet bob ?"
    )
    assert relay.formatter(1)(item) == "bob is in oslo . where will you meet alice ?"


def test_relay_transition_reports_an_empty_answer_as_nothing():
    item = {"city": "oslo", "open_places": ["park", "cafe"]}
    assert relay.relay_transition(item, ["", "museum"], History.empty(2)) == [
        "bob said museum . the park and the cafe are open . where will you meet bob ?",
        "alice said nothing . where will you meet alice ?",
    ]
    assert relay.relay_transition(item, ["?! park", " ."], History.empty(2))[0].startswith(
        "bob said nothing . the park"
    )


def test_relay_corpus_knows_every_word_of_both_turns():
    words = {word for line in relay.corpus() for word in line.split()}
    for item in relay.dataset():
        assert set(relay.formatter(0)(item).split()) | set(relay.formatter(1)(item).split()) <= words
        for a in (*PLACES, ""):
            for b in (*PLACES, ""):
                for prompt in relay.relay_transition(item, [a, b], History.empty(2)) or []:
                    assert set(prompt.split()) <= words, (item, a, b)


def test_relay_team_tokenizers_know_the_second_turn(tmp_path):
    """The team is the demo's two models, with tokenizers trained on the relay's text: no <unk> at turn 2."""
    from transformers import AutoTokenizer

    item = {"city": "oslo", "open_places": ["park", "cafe"]}
    turn_2 = relay.relay_transition(item, ["", "museum"], History.empty(2))
    for path in relay.build_team(tmp_path):
        tokenizer = AutoTokenizer.from_pretrained(path)
        for prompt in turn_2:
            tokens = tokenizer.tokenize(prompt)
            assert tokens == prompt.split(), (path.name, tokens)


def _episode_return(item, turns, discount):
    """The discounted team return of playing ``turns`` (joint answers) until the episode ends."""
    env = FunctionEnv(
        relay.relay_reward,
        [relay.formatter(0), relay.formatter(1)],
        num_agents=2,
        reward_call="batched",
        transition=relay.relay_transition,
        num_turns=2,
    )
    env.reset(item)
    total = 0.0
    for t, answers in enumerate(turns):
        result = env.step(answers)
        total += discount**t * sum(result.rewards) / 2
        if result.done:
            break
    assert result.done
    return total


def test_matching_at_turn_1_returns_at_least_as_much_as_missing_first():
    """The score is paid when the episode ends: a miss then a match returns 1.0 with discount 1, and less than
    matching at once with discount < 1 — failing first never pays (it paid 0.5 + 1.0 = 1.5)."""
    item = {"city": "oslo", "open_places": ["park", "cafe"]}
    at_once = _episode_return(item, [["park", "park"]], discount=1.0)
    assert at_once == 1.0
    misses = [
        [a, b] for a in (*PLACES, "") for b in (*PLACES, "") if not (a == b and a in item["open_places"])
    ]
    for miss in misses:
        assert _episode_return(item, [miss, ["cafe", "cafe"]], discount=1.0) == pytest.approx(1.0), miss
        assert _episode_return(item, [miss, ["cafe", "cafe"]], discount=0.9) < at_once, miss
    # two misses return the last turn's score: naming one open place each is 0.5, whatever came before
    assert _episode_return(item, [["museum", "station"], ["park", "cafe"]], discount=1.0) == 0.5


def _trainer(paths, num_turns, steps):
    args = MAGRPOConfig(
        max_steps=steps,
        prompts_per_step=6,
        num_generations=8,
        joint_mode="cross",
        max_joint_actions=16,
        max_children=4,
        num_turns=num_turns,
        max_new_tokens=3,
        learning_rate=1e-3,
        reward_call="batched",
        success_threshold=1.0,
        seed=0,
        progress_bar=False,
    )
    return MAGRPOTrainer(
        agents=[str(p) for p in paths],
        train_dataset=relay.dataset(),
        eval_dataset=relay.dataset(),
        # a one-turn episode ends at turn 1, so it is paid the game's score there
        reward_func=relay.relay_reward if num_turns > 1 else relay.meeting_reward,
        formatters=[relay.formatter(0), relay.formatter(1)],
        transition=relay.relay_transition if num_turns > 1 else None,
        args=args,
    )


@pytest.mark.slow
def test_multi_turn_training_beats_single_turn_on_the_relay_game(tmp_path):
    """Seeded: evaluated on two-turn episodes, a team trained on two turns succeeds >= 80%, one trained on
    the first turn alone stays near the ~50% that guessing allows. (Success moves in steps of 1/6 here; after 250
    steps seeds 0-2 reach 0.83, 1.0, 1.0, holding 5/6 from steps 175, 200 and 150: 0.9 has no margin.)"""
    paths = relay.build_team(tmp_path / "models")
    single = _trainer(paths, num_turns=1, steps=100)
    single.train()
    single.save_model(tmp_path / "single")
    trained_single = [tmp_path / "single" / f"agent_{i}" for i in range(2)]
    single_success = _trainer(trained_single, num_turns=2, steps=1).evaluate()["eval/success"]
    multi = _trainer(paths, num_turns=2, steps=250)
    multi.train()
    result = multi.evaluate()
    assert result["eval/success"] >= 0.8
    assert single_success <= 0.6
    assert result["eval/turn_2/reward"] > 0.5  # the second turn is where the multi-turn team wins
