"""Writing collaboration: every reward by hand, the success flag, the data, and two training steps offline."""

from __future__ import annotations

import pytest

from comarl import MAGRPOConfig, MAGRPOTrainer
from comarl.tasks import writing

# 10 words, 9 distinct ("the" twice); content words: starter rose loaf stayed flat dense.
SUMMARY = "The starter rose, but the loaf stayed flat and dense."
# 25 words, 23 distinct ("the", "time" twice); 15 content words, two shared with SUMMARY: loaf, flat.
EXPANSION = (
    "My kitchen was cold, so the dough needed more time to rise before baking and the loaf came out flat. "
    "Next time I will wait."
)
TLDR = writing.STYLES["tldr"]


def test_words_and_band_score():
    assert writing.words("Don't panic: 42 Cats!") == ["don't", "panic", "42", "cats"]
    assert writing.words("  ") == []
    # any script, curly apostrophes: this sentence is 8 words (it counted 11: "na", "ve", "caf", "doesn", "t", ...)
    assert writing.words("The naïve barista’s café doesn’t open before noon") == [
        "the", "naïve", "barista’s", "café", "doesn’t", "open", "before", "noon"
    ]  # fmt: skip
    assert writing.words("Привет, мир_2") == ["привет", "мир", "2"]  # Russian counted 0 words; _ splits
    assert writing.band_score(0, 2, 3) == 0.0
    assert writing.band_score(1, 2, 3) == 0.5  # below: value / low
    assert writing.band_score(2, 2, 3) == 1.0 and writing.band_score(3, 2, 3) == 1.0
    assert writing.band_score(6, 2, 3) == 0.5  # above: high / value


def test_structure_reward_by_hand():
    assert writing.structure_reward([SUMMARY, EXPANSION], TLDR.bounds) == 1.0  # 10 in [8, 30], 25 in [20, 90]
    four, many = "one two three four", " ".join(["word"] * 180)
    # 4 words: 4/8 = 0.5; 180 words: 90/180 = 0.5
    assert writing.structure_reward([four, many], TLDR.bounds) == 0.5
    assert writing.structure_reward([four, EXPANSION], TLDR.bounds) == 0.75
    assert writing.structure_reward(["", ""], TLDR.bounds) == 0.0


def test_coordination_reward_by_hand():
    assert writing.coordination_reward(SUMMARY, EXPANSION, (2.0, 3.0)) == 1.0  # 25 / 10 = 2.5
    assert writing.coordination_reward("a b c d", "e f g h", (2.0, 3.0)) == 0.5  # ratio 1: 1/2
    assert writing.coordination_reward("a b", "c d e f g h i j k l m n", (2.0, 3.0)) == 0.5  # ratio 6: 3/6
    assert writing.coordination_reward("", EXPANSION, (2.0, 3.0)) == 0.0


def test_diversity_reward_by_hand():
    assert writing.diversity_reward([SUMMARY, EXPANSION]) == pytest.approx((9 / 10 + 23 / 25) / 2)
    assert writing.diversity_reward(["cat cat cat cat", "dog bird"]) == pytest.approx((1 / 4 + 1) / 2)
    assert writing.diversity_reward(["", "dog"]) == 0.5


def test_non_redundancy_reward_by_hand():
    assert writing.content_words(SUMMARY) == {"starter", "rose", "loaf", "stayed", "flat", "dense"}
    assert len(writing.content_words(EXPANSION)) == 15
    assert writing.non_redundancy_reward(SUMMARY, EXPANSION) == pytest.approx(1 - 2 / 19)  # union 6 + 15 - 2
    assert writing.non_redundancy_reward("red apples", "green pears") == 1.0
    assert writing.non_redundancy_reward("red apples", "The apples are red.") == 0.0
    assert writing.non_redundancy_reward("the and of", "") == 0.0  # no content words at all


def test_total_is_the_weighted_sum_and_success_needs_every_constraint():
    components, success = writing.score_parts(SUMMARY, EXPANSION, TLDR)
    diversity, non_redundancy = (0.9 + 0.92) / 2, 1 - 2 / 19
    assert components["structure"] == 1.0 and components["coordination"] == 1.0
    assert components["total"] == pytest.approx(0.3 + 0.3 + 0.2 * diversity + 0.2 * non_redundancy)
    assert set(components) == set(writing.COMPONENTS) and success
    ten = "one two three four five six seven eight nine ten"
    assert writing.constraints_hold(ten, " ".join(["w"] * 20), TLDR)  # ratio 2.0: on the band's edge
    assert not writing.constraints_hold(ten, " ".join(["w"] * 35), TLDR)  # bounds hold, ratio 3.5 does not
    assert not writing.constraints_hold("one two three four five six seven", " ".join(["w"] * 20), TLDR)
    assert not writing.constraints_hold("", "", TLDR)


def test_constraints_hold_on_the_upper_edges_of_every_band():
    """The bounds and the ratio band are closed at the top too: 30 and 90 words (ratio 3.0) pass, one more fails."""
    thirty, ninety = " ".join(["w"] * 30), " ".join(["w"] * 90)
    assert writing.constraints_hold(thirty, ninety, TLDR)
    assert not writing.constraints_hold(thirty + " w", ninety, TLDR)  # 31 > 30
    assert not writing.constraints_hold(thirty, ninety + " w", TLDR)  # 91 > 90
    abstract, twenty = writing.STYLES["abstract"], " ".join(["w"] * 20)
    assert writing.constraints_hold(twenty, " ".join(["w"] * 40), abstract)  # ratio 2.0: the band's top
    assert not writing.constraints_hold(twenty, " ".join(["w"] * 50), abstract)  # ratio 2.5 > 2.0


def test_split_parts_on_the_marker_line():
    assert writing.split_parts("a b\n---\nc d\n--- e") == ("a b", "c d\n--- e")
    assert writing.split_parts("a b\n  ---  \nc d") == ("a b", "c d")
    assert writing.split_parts("a --- b") == ("a --- b", "")  # not on its own line: no split
    assert writing.split_parts("  a b  \n---\n  c d  \n") == ("a b", "c d")  # each part stripped


def test_env_two_agents_one_agent_and_errors():
    item = writing.load_items("eval")[0]
    env = writing.WritingCollabEnv()
    prompts = env.reset(item)
    assert prompts == [writing.agent_prompt(item, 0), writing.agent_prompt(item, 1)]
    assert item["post"] in prompts[0] and prompts[0].endswith("TL;DR:") and prompts[1].endswith("Expansion:")
    other = env.fork()  # each item's own episode: resetting a fork leaves the env's item alone
    assert other.reset(writing.load_items("eval")[1]) != prompts and env.item is item
    result = env.step([SUMMARY, EXPANSION])
    expected, _ = writing.score_parts(SUMMARY, EXPANSION, TLDR)
    assert result.components == expected and result.rewards == [expected["total"]] * 2
    assert result.done and result.info == {"success": True, "words": [10, 25]}

    single = writing.WritingCollabEnv(num_agents=1)
    assert single.reset(item) == [writing.single_prompt(item)]
    one = single.step([f"{SUMMARY}\n---\n{EXPANSION}"])
    assert one.rewards == [expected["total"]] and one.info["success"]
    assert single.step([SUMMARY]).info == {"success": False, "words": [10, 0]}

    abstract = writing.WritingCollabEnv(style="abstract")
    assert abstract.reset(item)[1].endswith("Method:")
    # 10 words of background (bounds [20, 60]): 10/20; 25 words of method (bounds [30, 120]): 25/30
    assert abstract.step([SUMMARY, EXPANSION]).components["structure"] == pytest.approx((0.5 + 25 / 30) / 2)

    single_abstract = writing.WritingCollabEnv(num_agents=1, style="abstract")
    assert single_abstract.reset(item) == [writing.single_prompt(item, "abstract")]
    assert abstract.reset(item) == [
        writing.agent_prompt(item, 0, "abstract"),
        writing.agent_prompt(item, 1, "abstract"),
    ]

    with pytest.raises(ValueError, match="num_agents=3; the writing task has 2 parts"):
        writing.WritingCollabEnv(num_agents=3)
    with pytest.raises(ValueError, match=r"weights has keys \['total'\]"):
        writing.WritingCollabEnv(weights={"total": 1.0})
    doubled = {name: 2 * w for name, w in writing.DEFAULT_WEIGHTS.items()}  # full marks would be 2.0
    with pytest.raises(ValueError, match=r"WritingCollabEnv: weights .* must be numbers >= 0 that sum to 1"):
        writing.WritingCollabEnv(weights=doubled)
    with pytest.raises(ValueError, match="style='poem'"):
        writing.WritingCollabEnv(style="poem")
    with pytest.raises(ValueError, match="num_turns=2: the writing task is single-turn"):
        writing.make_env(2, 2)


def test_custom_weights_set_the_reward():
    """The env scores with its own weights: structure alone gives the structure score (0.75 here), not the total."""
    env = writing.WritingCollabEnv(
        weights={"structure": 1.0, "coordination": 0.0, "diversity": 0.0, "non_redundancy": 0.0}
    )
    env.reset(writing.load_items("eval")[0])
    # 4 words of summary: 4/8 = 0.5; 25 words of expansion in [20, 90]: 1
    result = env.step(["one two three four", EXPANSION])
    assert result.rewards == [0.75, 0.75] and result.components["total"] == 0.75


def test_prompts_state_each_agents_own_bounds():
    """Each agent is told its own part's word bounds (and agent 1 the ratio); the one-agent prompt asks for both."""
    item = writing.load_items("eval")[0]
    summary, expansion = writing.agent_prompt(item, 0), writing.agent_prompt(item, 1)
    assert "a concise summary in 8 to 30 words." in summary and "expansion" not in summary
    assert (
        "detailed expansion of this post in 20 to 90 words, 2 to 3 times as long as its summary." in expansion
    )
    single = writing.single_prompt(item)
    assert (
        "in 8 to 30 words." in single
        and "Then: Write a detailed expansion of this post in 20 to 90" in single
    )
    background, method = writing.agent_prompt(item, 0, "abstract"), writing.agent_prompt(item, 1, "abstract")
    assert f"TITLE: {item['title']}\nIDEA: {item['post']}\n\n" in background
    assert "background of a paper abstract on this idea in 20 to 60 words." in background
    assert "method of a paper abstract on this idea in 30 to 120 words, 1 to 2 times as long" in method


def test_pipeline_prompt_shows_agent_0s_part():
    item = writing.load_items("eval")[0]
    prompt = writing.pipeline_prompt(item, "  knee healed, half marathon done  ")
    assert "Your teammate wrote the summary:\nknee healed, half marathon done\n" in prompt
    assert item["post"] in prompt and prompt.endswith("Expansion:")


def test_local_splits_are_fixed_and_disjoint():
    eval_items, train_items = writing.load_items("eval"), writing.load_items("train")
    assert [it["id"] for it in eval_items] == ["local-3", "local-7", "local-11", "local-15"]
    assert [it["id"] for it in train_items] == [f"local-{i}" for i in range(16) if i % 4 != 3]
    assert writing.load_items() == eval_items  # split="eval", source="local" by default
    with pytest.raises(ValueError, match="split='test'; choose 'train' or 'eval'"):
        writing.load_items("test")
    with pytest.raises(ValueError, match="source='web'"):
        writing.load_items("eval", "web")


RECORD = {
    "prompt": "SUBREDDIT: r/AskReddit\n\nTITLE: How do I stop putting things off?\n\n"
    "POST: I have an exam on Monday.\n\nI keep watching videos instead.\n\nTL;DR:",
    "completion": " exam soon, watching videos, help",
}


def test_tldr_converter_on_a_hand_written_record():
    assert writing.tldr_record_to_item(RECORD, 7) == {
        "id": "tldr-7",
        "subreddit": "AskReddit",
        "title": "How do I stop putting things off?",
        "post": "I have an exam on Monday.\n\nI keep watching videos instead.",
        "reference": "exam soon, watching videos, help",
    }
    with pytest.raises(ValueError, match="row 3 has no 'SUBREDDIT"):
        writing.tldr_record_to_item({"prompt": "hello", "completion": "x"}, 3)


def test_tldr_source_reads_the_test_split_for_eval(monkeypatch):
    import datasets

    asked = []

    def fake_load_dataset(name, split):
        asked.append((name, split))
        return [RECORD, RECORD]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    items = writing.load_items("eval", "tldr")
    assert asked == [("trl-lib/tldr", "test")] and [it["id"] for it in items] == ["tldr-0", "tldr-1"]
    writing.load_items("train", "tldr")
    assert asked[-1] == ("trl-lib/tldr", "train")


def test_two_training_steps_offline(tmp_path):
    """The plumbing: the env's total is the reward the trainer sees, and every component is logged."""
    paths = writing.build_team(tmp_path / "models")
    trainer = MAGRPOTrainer(
        agents=[str(p) for p in paths],
        train_dataset=writing.load_items("train"),
        env=writing.WritingCollabEnv(),
        args=MAGRPOConfig(
            max_steps=2, prompts_per_step=2, num_generations=2, max_new_tokens=6, progress_bar=False
        ),
    )
    assert [type(a.model).__name__ for a in trainer.team] == ["LlamaForCausalLM", "GPT2LMHeadModel"]
    metrics = trainer.train()
    assert trainer.step == 2
    for name in writing.COMPONENTS:
        assert 0.0 <= metrics[f"reward/{name}"] <= 1.0
    assert metrics["reward"] == pytest.approx(metrics["reward/total"])  # the shared reward is the total
    assert metrics["success"] == 0.0  # 6 tokens cannot make a 20-word expansion
    assert "agent_0/loss" in metrics and "agent_1/loss" in metrics
