"""Writing collaboration: two agents write complementary parts of one text.

Two styles, each a pair of parts with word-count bounds and a target ratio between them:

- ``"tldr"`` (default): on a Reddit-style post, agent 0 writes a concise summary (the TL;DR) and
  agent 1 a detailed expansion, 2 to 3 times as long as the summary.
- ``"abstract"``: on a title and an idea, agent 0 writes the background and agent 1 the method
  of a paper abstract, the method 1 to 2 times as long as the background.

The team shares one reward, a weighted sum of four components, each a pure function below::

    structure       mean over the parts of band_score(words, low, high)         (length bounds)
    coordination    band_score(words(part 1) / words(part 0), ratio band)        (length ratio)
    diversity       mean over the parts of distinct words / words                (type-token ratio)
    non_redundancy  1 - Jaccard(content words of part 0, content words of part 1)
    total           0.3 structure + 0.3 coordination + 0.2 diversity + 0.2 non_redundancy

``info["success"]`` is True when every structural constraint holds: both parts within their
bounds and the ratio inside its band. With ``num_agents=1`` one model writes both parts in one
answer, separated by a line holding only ``---`` (:data:`PART_MARKER`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comarl.envs import Env, StepResult, check_weights, step_in_place

PART_MARKER = "---"
DEFAULT_WEIGHTS = {"structure": 0.3, "coordination": 0.3, "diversity": 0.2, "non_redundancy": 0.2}
COMPONENTS = (*DEFAULT_WEIGHTS, "total")
SPLITS = ("train", "eval")
SOURCES = ("local", "tldr")

# Function words left out of the redundancy check: sharing "the" is not repeating content.
# fmt: off
STOPWORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "been", "but", "by", "can", "could", "did", "do", "does",
    "for", "from", "had", "has", "have", "he", "her", "his", "i", "if", "in", "into", "is", "it", "its",
    "just", "me", "my", "no", "not", "of", "on", "or", "our", "she", "so", "than", "that", "the", "their",
    "them", "then", "there", "they", "this", "to", "too", "was", "we", "were", "what", "when", "which",
    "who", "will", "with", "would", "you", "your",
})
# fmt: on


@dataclass(frozen=True)
class WritingStyle:
    """The two parts of a text: names, word-count bounds, and the target band of words(part 1) / words(part 0)."""

    name: str
    parts: tuple[str, str]
    bounds: tuple[tuple[int, int], tuple[int, int]]
    ratio_band: tuple[float, float]


STYLES = {
    "tldr": WritingStyle("tldr", ("summary", "expansion"), ((8, 30), (20, 90)), (2.0, 3.0)),
    "abstract": WritingStyle("abstract", ("background", "method"), ((20, 60), (30, 120)), (1.0, 2.0)),
}


# ----------------------------------------------------------------------------- rewards (pure)


def words(text: str) -> list[str]:
    """The words of a text: lower-cased runs of letters and digits in any script (inner apostrophes kept, straight
    or curly: "don't", "doesn’t"; "café" and "naïve" are one word each)."""
    return re.findall(r"[^\W_]+(?:['’][^\W_]+)*", text.lower())


def band_score(value: float, low: float, high: float) -> float:
    """1 inside ``[low, high]``, ``value / low`` below it, ``high / value`` above it; 0 when ``value <= 0``.

    Continuous and in [0, 1], so a part slightly out of bounds still earns most of the credit.
    """
    if value <= 0:
        return 0.0
    if value < low:
        return value / low
    if value > high:
        return high / value
    return 1.0


def structure_reward(parts: Sequence[str], bounds: Sequence[tuple[int, int]]) -> float:
    """Length bounds: mean over the parts of ``band_score(len(words(part)), low, high)``."""
    return sum(band_score(len(words(p)), lo, hi) for p, (lo, hi) in zip(parts, bounds)) / len(parts)


def coordination_reward(first: str, second: str, ratio_band: tuple[float, float]) -> float:
    """Length ratio: ``band_score(len(words(second)) / len(words(first)), *ratio_band)``; 0 if ``first`` is empty."""
    first_count = len(words(first))
    if first_count == 0:
        return 0.0
    return band_score(len(words(second)) / first_count, *ratio_band)


def diversity_reward(parts: Sequence[str]) -> float:
    """Vocabulary diversity: mean over the parts of the type-token ratio ``distinct words / words`` (0 if empty)."""
    ratios = []
    for part in parts:
        tokens = words(part)
        ratios.append(len(set(tokens)) / len(tokens) if tokens else 0.0)
    return sum(ratios) / len(ratios)


def content_words(text: str) -> set[str]:
    """The distinct words of a text that are not in :data:`STOPWORDS`."""
    return set(words(text)) - STOPWORDS


def non_redundancy_reward(first: str, second: str) -> float:
    """``1 - |A & B| / |A | B|`` for the content words A, B of the two parts; 0 when both have none."""
    a, b = content_words(first), content_words(second)
    if not a | b:
        return 0.0
    return 1.0 - len(a & b) / len(a | b)


def total_reward(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """The team reward: ``sum(weights[name] * components[name])``."""
    return sum(weight * components[name] for name, weight in weights.items())


def constraints_hold(first: str, second: str, style: WritingStyle) -> bool:
    """Every structural constraint: each part within its word bounds and the length ratio inside the band."""
    counts = [len(words(first)), len(words(second))]
    if not all(lo <= n <= hi for n, (lo, hi) in zip(counts, style.bounds)):
        return False
    low, high = style.ratio_band
    return counts[0] > 0 and low <= counts[1] / counts[0] <= high


def score_parts(
    first: str, second: str, style: WritingStyle, weights: Mapping[str, float] = DEFAULT_WEIGHTS
) -> tuple[dict[str, float], bool]:
    """Every reward component of one text (``total`` included) and whether the constraints hold."""
    components = {
        "structure": structure_reward([first, second], style.bounds),
        "coordination": coordination_reward(first, second, style.ratio_band),
        "diversity": diversity_reward([first, second]),
        "non_redundancy": non_redundancy_reward(first, second),
    }
    components["total"] = total_reward(components, weights)
    return components, constraints_hold(first, second, style)


def split_parts(answer: str) -> tuple[str, str]:
    """Split a one-agent answer at its first :data:`PART_MARKER` line; no marker: all of it is part 0."""
    lines = answer.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == PART_MARKER:
            return "\n".join(lines[:i]).strip(), "\n".join(lines[i + 1 :]).strip()
    return answer.strip(), ""


# ----------------------------------------------------------------------------- prompts


def _context(item: Mapping[str, Any], style: WritingStyle) -> str:
    if style.name == "tldr":
        return f"SUBREDDIT: r/{item['subreddit']}\nTITLE: {item['title']}\nPOST: {item['post']}\n\n"
    return f"TITLE: {item['title']}\nIDEA: {item['post']}\n\n"


def _task_line(style: WritingStyle, part: int) -> str:
    (lo0, hi0), (lo1, hi1) = style.bounds
    low, high = style.ratio_band
    if style.name == "tldr" and part == 0:
        return f"Write a TL;DR of this post: a concise summary in {lo0} to {hi0} words."
    if style.name == "tldr":
        return (
            f"Write a detailed expansion of this post in {lo1} to {hi1} words, {low:g} to {high:g} times as long "
            "as its summary. Add details; do not repeat the summary."
        )
    if part == 0:
        return f"Write the background of a paper abstract on this idea in {lo0} to {hi0} words."
    return (
        f"Write the method of a paper abstract on this idea in {lo1} to {hi1} words, {low:g} to {high:g} times "
        "as long as the background. Describe the approach; do not repeat the background."
    )


def _cue(style: WritingStyle, part: int) -> str:
    return ("TL;DR:", "Expansion:")[part] if style.name == "tldr" else ("Background:", "Method:")[part]


def agent_prompt(item: Mapping[str, Any], agent: int, style: str = "tldr") -> str:
    """Agent ``agent``'s prompt in the two-agent team: agent 0 writes part 0, agent 1 part 1."""
    s = _style(style)
    return f"{_context(item, s)}{_task_line(s, agent)}\n{_cue(s, agent)}"


def single_prompt(item: Mapping[str, Any], style: str = "tldr") -> str:
    """The one-agent prompt: both parts in one answer, separated by a line holding only ``---``."""
    s = _style(style)
    return (
        f"{_context(item, s)}{_task_line(s, 0)}\nThen write a line holding only three dashes ({PART_MARKER}).\n"
        f"Then: {_task_line(s, 1)}\n{_cue(s, 0)}"
    )


def pipeline_prompt(item: Mapping[str, Any], first_completion: str, style: str = "tldr") -> str:
    """Agent 1's prompt when it sees agent 0's part first (the pipeline baseline)."""
    s = _style(style)
    return (
        f"{_context(item, s)}Your teammate wrote the {s.parts[0]}:\n{first_completion.strip()}\n\n"
        f"{_task_line(s, 1)}\n{_cue(s, 1)}"
    )


def _style(name: str) -> WritingStyle:
    if name not in STYLES:
        raise ValueError(f"style={name!r}: choose one of {sorted(STYLES)}")
    return STYLES[name]


# ----------------------------------------------------------------------------- environment


class WritingCollabEnv(Env):
    """Two agents (or one writing both parts) on one item; one shared reward with logged components.

    ``num_agents=2``: agent 0 writes part 0, agent 1 part 1 (see :func:`agent_prompt`).
    ``num_agents=1``: one answer holding both parts, split with :func:`split_parts`.
    ``weights`` maps each of structure, coordination, diversity, non_redundancy to its weight.
    """

    def __init__(
        self, num_agents: int = 2, style: str = "tldr", weights: Mapping[str, float] | None = None
    ) -> None:
        if num_agents not in (1, 2):
            raise ValueError(
                f"WritingCollabEnv: num_agents={num_agents}; the writing task has 2 parts: use 2 agents, or 1 agent "
                "writing both parts"
            )
        weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        check_weights("WritingCollabEnv", weights, DEFAULT_WEIGHTS)
        self.num_agents = num_agents
        self.style = _style(style)
        self.weights = weights
        self.item: Mapping[str, Any] = {}

    def fork(self) -> Env:
        """A shallow copy: ``reset`` and ``step`` replace the per-episode attributes."""
        return copy.copy(self)

    def reset(self, item: Mapping[str, Any]) -> list[str]:
        self.item = item
        if self.num_agents == 1:
            return [single_prompt(item, self.style.name)]
        return [agent_prompt(item, 0, self.style.name), agent_prompt(item, 1, self.style.name)]

    def step(self, joint_action: Sequence[str]) -> StepResult:
        return step_in_place(self, joint_action)

    def step_many(
        self, episodes: Sequence[Env], joint_actions: Sequence[Sequence[Sequence[str]]]
    ) -> list[list[StepResult]]:
        """Score every joint action; one turn, so each branch is just a copy of its episode."""
        results = []
        for episode, actions in zip(episodes, joint_actions):
            row = []
            for action in actions:
                first, second = split_parts(action[0]) if self.num_agents == 1 else (action[0], action[1])
                components, success = score_parts(first, second, self.style, self.weights)
                result = StepResult(
                    rewards=[components["total"]] * self.num_agents,
                    done=True,
                    info={"success": success, "words": [len(words(first)), len(words(second))]},
                    components=components,
                )
                result.episode = copy.copy(episode)
                row.append(result)
            results.append(row)
        return results

    def close(self) -> None:
        """Nothing to release (the evaluation protocol closes every task's environment)."""


def make_env(num_agents: int = 2, num_turns: int = 1) -> WritingCollabEnv:
    """The evaluation protocol's constructor: the writing task is single-turn."""
    if num_turns != 1:
        raise ValueError(f"num_turns={num_turns}: the writing task is single-turn; use num_turns=1")
    return WritingCollabEnv(num_agents=num_agents)


# ----------------------------------------------------------------------------- data

# Hand-written short posts for tests and offline runs. Every fourth one (ids 3, 7, 11, 15) is the eval split.
LOCAL_POSTS = [
    (
        "cooking",
        "My first loaf of sourdough came out flat",
        "I fed my starter for two weeks and it doubled every morning. The dough felt sticky, so I added more "
        "flour and baked it at noon. The crust was dark but the loaf was flat and dense inside. A friend says "
        "my kitchen is too cold and the dough needed more time to rise before baking.",
    ),
    (
        "personalfinance",
        "Paid off my car loan two years early",
        "I started by rounding every payment up to the next hundred dollars. Later I sent my tax refund and a "
        "small bonus straight to the loan. Last week the bank sent a letter saying the balance is zero. Now I "
        "plan to keep paying the same amount into a savings account for the next car.",
    ),
    (
        "gardening",
        "Tomatoes keep splitting before they ripen",
        "This summer most of my tomatoes cracked near the stem just before turning red. We had a dry month "
        "and then three days of heavy rain. I water by hand when I remember, sometimes twice a day and "
        "sometimes not for a week. The plants look healthy and the leaves are green.",
    ),
    (
        "running",
        "Finished my first half marathon after a knee injury",
        "Last spring I hurt my knee and could not run for four months. A physical therapist gave me slow "
        "strength exercises and I walked every day. In August I began running again, one mile at a time. "
        "On Sunday I finished the half marathon in two hours and ten minutes without pain.",
    ),
    (
        "relationships",
        "My roommate and I cannot agree on chores",
        "We share a small apartment and the dishes pile up every week. I clean the kitchen on weekends and "
        "my roommate says he cleans the bathroom, but it rarely happens. We tried a paper schedule on the "
        "fridge and it lasted five days. I do not want to lose a good friend over a sink.",
    ),
    (
        "learnprogramming",
        "Six months of learning Python and I still feel lost",
        "I finished two online courses and can write loops, functions and small classes. When I try to build "
        "a real project I do not know where to start and give up after an hour. People tell me to pick "
        "something tiny, like a script that renames my photos, and finish it before starting anything else.",
    ),
    (
        "travel",
        "Missed my connecting flight in Lisbon",
        "My first flight landed forty minutes late and the gate for the connection had already closed. The "
        "airline put me on a flight the next morning and gave me a hotel voucher. I spent the evening "
        "walking through the old town, ate grilled sardines, and watched the sunset from a hill.",
    ),
    (
        "homeimprovement",
        "Replaced a leaking kitchen faucet by myself",
        "The old faucet dripped all night and the water bill went up. I watched a few videos, shut off the "
        "valves under the sink and removed the old fixture with a basin wrench. The new faucet took two "
        "hours to install because one nut was rusted. It has not leaked for three weeks.",
    ),
    (
        "books",
        "Reading one book a week for a year",
        "In January I set a goal of fifty two books. I read on the train, at lunch and for thirty minutes "
        "before bed instead of scrolling my phone. By December I had finished forty eight, mostly history "
        "and a few novels. I sleep better and remember more of what I read when I take short notes.",
    ),
    (
        "pets",
        "Our rescue dog is afraid of the vacuum",
        "We adopted a three year old dog from a shelter in March. She is calm with people and other dogs, "
        "but she hides under the bed whenever the vacuum runs. The trainer suggested leaving the vacuum off "
        "in the room and giving her treats near it, then turning it on for a few seconds at a time.",
    ),
    (
        "cycling",
        "Commuting by bike through the winter",
        "I ride eight miles to work and decided to keep going when it got cold. Good gloves, a wind jacket "
        "and bright lights made the biggest difference. Ice on the bridge scared me twice, so on those days "
        "I take the bus. I have saved money on parking and feel more awake at my desk.",
    ),
    (
        "jobs",
        "Got the job after three rounds of interviews",
        "The first interview was a phone call with a recruiter about my experience. The second was a coding "
        "exercise where I talked through my solution while writing it. In the third I met the team and asked "
        "about their projects. They called two days later with an offer that was higher than I expected.",
    ),
    (
        "photography",
        "My night photos are always blurry",
        "I bought a used camera and love taking pictures of the city at night. Every shot of the streets "
        "comes out soft and shaky even when I hold my breath. A shop owner told me to use a tripod, a lower "
        "shutter speed and a two second timer so my finger does not move the camera.",
    ),
    (
        "fitness",
        "Lost fifteen pounds by walking after dinner",
        "I did not change much except one habit: a thirty minute walk after dinner every evening. At first "
        "it was boring, so I started listening to podcasts and calling my sister. After five months I had "
        "lost fifteen pounds, my sleep improved, and I snack less late at night.",
    ),
    (
        "parenting",
        "Getting a toddler to sleep in her own bed",
        "Our daughter is two and wakes up every night to climb into our bed. We started a routine with a "
        "bath, one book and a song, then we sit by her door for a few minutes. The first week was hard, with "
        "lots of crying. Now she sleeps through most nights and asks for the same song.",
    ),
    (
        "science",
        "Why does the moon look bigger near the horizon",
        "Last night the rising moon looked huge over the hills, but an hour later it seemed normal again. My "
        "photos show it is the same size in both positions. I read that this is the moon illusion and that "
        "our brain judges size from nearby objects like trees and buildings on the horizon.",
    ),
]


def local_items() -> list[dict[str, Any]]:
    """Every hand-written post as an item: ``id``, ``subreddit``, ``title``, ``post``."""
    return [
        {"id": f"local-{i}", "subreddit": sub, "title": title, "post": post}
        for i, (sub, title, post) in enumerate(LOCAL_POSTS)
    ]


_TLDR_PROMPT = re.compile(
    r"SUBREDDIT: r/(?P<subreddit>.*?)\n\nTITLE: (?P<title>.*?)\n\nPOST: (?P<post>.*)\n\nTL;DR:\s*$", re.S
)


def tldr_record_to_item(record: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Convert a ``trl-lib/tldr`` row (``prompt``, ``completion``) into a writing item.

    Its prompt reads ``"SUBREDDIT: r/<sub>\\n\\nTITLE: <title>\\n\\nPOST: <post>\\n\\nTL;DR:"``; the
    completion (the author's TL;DR) is kept as ``reference``.
    """
    match = _TLDR_PROMPT.match(str(record.get("prompt", "")))
    if match is None:
        raise ValueError(
            f"tldr_record_to_item: row {index} has no 'SUBREDDIT: r/...\\n\\nTITLE: ...\\n\\nPOST: ...\\n\\nTL;DR:' "
            f"prompt (got {str(record.get('prompt'))[:80]!r}); is this trl-lib/tldr?"
        )
    return {
        "id": f"tldr-{index}",
        "subreddit": match["subreddit"].strip(),
        "title": match["title"].strip(),
        "post": match["post"].strip(),
        "reference": str(record.get("completion", "")).strip(),
    }


def load_items(split: str = "eval", source: str = "local") -> list[dict[str, Any]]:
    """The items of ``split`` ("train" or "eval") from ``source``.

    ``"local"``: the 16 hand-written posts, fixed split: ids 3, 7, 11, 15 are eval, the other 12 train.
    ``"tldr"``: ``trl-lib/tldr`` through ``datasets.load_dataset`` (network): its train split for
    "train", its test split for "eval".
    """
    if split not in SPLITS:
        raise ValueError(f"load_items: split={split!r}; choose 'train' or 'eval'")
    if source == "local":
        return [item for i, item in enumerate(local_items()) if (i % 4 == 3) == (split == "eval")]
    if source == "tldr":
        import datasets

        rows = datasets.load_dataset("trl-lib/tldr", split="train" if split == "train" else "test")
        return [tldr_record_to_item(row, i) for i, row in enumerate(rows)]
    raise ValueError(f"load_items: source={source!r}; choose one of {list(SOURCES)}")


def corpus() -> list[str]:
    """Local text the tiny models' word tokenizers are trained on: every prompt and every post."""
    lines = []
    for item in local_items():
        for style in STYLES:
            lines += [agent_prompt(item, 0, style), agent_prompt(item, 1, style), single_prompt(item, style)]
            lines.append(pipeline_prompt(item, item["title"], style))
        lines.append(PART_MARKER)
    return lines


def build_team(base_dir: str | Path, seed: int = 0) -> list[Path]:
    """Two tiny models (Llama and GPT-2) with word-level tokenizers trained on :func:`corpus`, saved to disk.

    512 positions: the prompts hold a whole post (about 200 words and punctuation tokens).
    """
    from comarl.tiny import tiny_model

    base, texts = Path(base_dir), corpus()
    return [
        tiny_model(
            base / "writer-llama",
            texts=texts,
            kind="word",
            vocab_size=2048,
            arch="llama",
            seed=seed,
            max_position_embeddings=512,
        ),
        tiny_model(
            base / "writer-gpt2",
            texts=texts,
            kind="word",
            vocab_size=2048,
            arch="gpt2",
            seed=seed + 1,
            max_position_embeddings=512,
        ),
    ]
