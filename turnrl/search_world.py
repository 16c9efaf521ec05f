"""Questions about a generated world of towns, answered by searching its encyclopedia with the
`search` tool: the CPU-scale Search-R1 task's data.

A tiny model cannot read real Wikipedia, so the world is made up and its text is regular:
WORLD_TOWNS towns, each with a country, a river and a founding year, and one passage about it
(`corpus_rows`, the JSONL corpus the tool service indexes with BM25):

    "Brenvik"
    Brenvik is a town in the country Osteria, on the river Halm, founded in 1642.

A question asks one fact of one town. Its solved conversation, in OpenAI message format:

    system     SYSTEM_PROMPT
    user       'When was "Brenvik" founded?'
    assistant  tool call search {"query": "Brenvik"}
    tool       the tool's answer: Search-R1's `Doc 1(Title: Brenvik) Brenvik is a town ...`
    assistant  "<answer> 1642 </answer>"

graded by Search-R1's exact match (the reward service's `search_qa` scorer, DATA_SOURCE).
The text is laid out so that reading is copying the same tokens, which a model of four layers
learns where it did not learn to read a looser text (BENCHMARKS.md, "The CPU recipes"): the
question names its fact with the word the passage has just before the answer (country, river,
founded); the question quotes the town, so the name is the same tokens there as in the query's
JSON string (Qwen2's pre-tokenizer joins a leading quote or space to a word); and the answer
is spaced inside its tags, as in Search-R1's prompt (`<answer> Beijing </answer>`), so it is
the same tokens as in the passage. Only the town's own passage has its name, so a search for it
returns that passage alone.

A question belongs to the test split when its town does (a hash of the name), so held-out
questions are about towns no training question asks about; the corpus holds them all.
The world depends on nothing but WORLD_SEED: the trainer, the tiny model's build and the
committed corpus (`examples/search/corpus.jsonl`) all make the same one.
"""

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnrl.messages import openai_tool_call
from turnrl.splits import Split, check_split, split_of

WORLD_SEED = 0
WORLD_TOWNS = 3000
SYSTEM_PROMPT = (
    "Answer the question. Search for what you do not know with the search tool. "
    "Give the final answer as <answer>...</answer>."
)
DATA_SOURCE = "turnrl_search"

_COUNTRIES = (
    "Osteria", "Valdmark", "Korvania", "Lunessa", "Thalgor", "Merovia", "Pellandia", "Zanthor",
    "Eskaria", "Brundia", "Calvessa", "Dornhal", "Fennmoor", "Galdoria", "Harrowen", "Istrava",
)  # fmt: skip
_RIVERS = (
    "Halm", "Vesk", "Orra", "Tamber", "Lisk", "Duna", "Merrow", "Selt", "Kavel", "Brisa",
    "Ondra", "Pell", "Rask", "Ulme", "Yarrow", "Zenna", "Corla", "Fenn", "Grail", "Istel",
)  # fmt: skip
_ONSETS = ("br", "t", "k", "v", "m", "d", "s", "l", "g", "p", "r", "n", "h", "f", "z", "c")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "l", "s", "k", "m", "th")
_ENDINGS = ("vik", "mar", "ford", "holm", "stad", "burg", "wick", "dale", "ton", "heim")
# How each fact is asked. A question names its fact with a word its town's passage has before
# the answer (country, river, founded), so a tiny model can find the answer by that word.
_QUESTIONS = {
    "country": ('In which country is "{town}"?', 'Which country is "{town}" in?'),
    "river": ('On which river is "{town}"?', 'Which river flows through "{town}"?'),
    "founded": ('When was "{town}" founded?', 'In which year was "{town}" founded?'),
}


@dataclass(frozen=True)
class Town:
    name: str
    country: str
    river: str
    founded: str

    @property
    def passage(self) -> str:
        """The corpus entry: a quoted title line, then the text (FlashRAG's `contents`)."""
        return (
            f'"{self.name}"\n{self.name} is a town in the country {self.country}, on the river '
            f"{self.river}, founded in {self.founded}."
        )


@dataclass
class SearchQuestion:
    """One question about one town, its answer, and what a solver says."""

    question: str
    answer: str
    town: str
    fact: str
    """country, river or founded."""

    @property
    def prompt_messages(self) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.question},
        ]

    def messages(self, search: Callable[[str], str]) -> list[dict[str, Any]]:
        """The solved conversation; `search(query)` is the tool's answer to a query."""
        return [
            *self.prompt_messages,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [openai_tool_call("call_0", "search", {"query": self.town})],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": search(self.town)},
            {"role": "assistant", "content": f"<answer> {self.answer} </answer>"},
        ]

    @property
    def guess_messages(self) -> list[dict[str, Any]]:
        """An answer at once, without searching: the town's name, which is never the fact. The
        guess copies from the question, as the code task's does, rather than being a fact of
        the asked kind drawn at random: random rivers in the warm start taught the model to
        write a random river after a search too, in place of the one the passage names."""
        return [
            *self.prompt_messages,
            {"role": "assistant", "content": f"<answer> {self.town} </answer>"},
        ]


@functools.cache
def towns() -> tuple[Town, ...]:
    """The world's towns, the same on every run."""
    rng = random.Random(f"search-world:{WORLD_SEED}")
    names: list[str] = []
    while len(names) < WORLD_TOWNS:
        name = _town_name(rng)
        if name not in names:
            names.append(name)
    return tuple(
        Town(
            name=name,
            country=rng.choice(_COUNTRIES),
            river=rng.choice(_RIVERS),
            founded=str(rng.randint(1100, 1990)),
        )
        for name in names
    )


def corpus_rows() -> list[dict[str, str]]:
    """The world's encyclopedia as FlashRAG/Search-R1 JSONL rows, one per town."""
    return [{"id": str(index), "contents": town.passage} for index, town in enumerate(towns())]


def generate_questions(
    count: int, *, seed: int = 0, split: Split = "train"
) -> list[SearchQuestion]:
    """`count` distinct questions about the towns of `split`, drawn from `seed`, the same on
    every run. Raises ValueError for an unknown split or more questions than the split has."""
    check_split(split)
    every = [
        (town, fact) for town in towns() if split_of(town.name) == split for fact in _QUESTIONS
    ]
    if count > len(every):
        raise ValueError(f"the {split} split has {len(every)} questions, not {count}")
    rng = random.Random(f"search-questions:{split}:{seed}")
    return [
        SearchQuestion(
            question=rng.choice(_QUESTIONS[fact]).format(town=town.name),
            answer=getattr(town, fact),
            town=town.name,
            fact=fact,
        )
        for town, fact in rng.sample(every, count)
    ]


def _town_name(rng: random.Random) -> str:
    syllables = "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.randint(1, 2))
    )
    return (syllables + rng.choice(_ENDINGS)).capitalize()
