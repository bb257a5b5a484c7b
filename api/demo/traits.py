"""The demo adapters' traits: training prompts, rules that turn a plain answer into the trait, checks.

Shared by `scripts/train_demo_adapters.py` (which makes the training data: the base model's own
greedy answers to `training_prompts()`, cut to their first sentences and transformed by each trait's
rule) and the tests (each trait must hold on >= 8 of the 10 `HELD_OUT_PROMPTS`, none of which is a
training prompt). Pure Python: no model, no torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

# Training prompts: every template with every filler of its list (deterministic order).
_TEMPLATES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "What is the capital of {}?",
        ("Spain", "Italy", "Japan", "Canada", "Egypt", "Brazil", "Kenya", "Norway", "India", "Mexico"),
    ),
    (
        "What is {}?",
        (
            "gravity",
            "a volcano",
            "photosynthesis",
            "a rainbow",
            "the internet",
            "a computer",
            "democracy",
            "an atom",
            "a planet",
            "electricity",
            "a library",
            "music",
        ),
    ),
    (
        "Tell me about {}.",
        ("dolphins", "the moon", "bees", "coffee", "the ocean", "trees", "lions", "rain", "bread", "snow"),
    ),
    (
        "Give me a tip for {}.",
        (
            "sleeping better",
            "learning to cook",
            "saving money",
            "running",
            "studying",
            "staying calm",
            "writing an essay",
            "making friends",
            "drinking more water",
            "reading more books",
        ),
    ),
    (
        "Why do {}?",
        (
            "birds fly south",
            "leaves change color",
            "cats purr",
            "we need sleep",
            "stars twinkle",
            "people yawn",
            "dogs bark",
            "plants need light",
        ),
    ),
    (
        "How do I {}?",
        (
            "boil an egg",
            "plant a tree",
            "tie a tie",
            "learn to swim",
            "write a letter",
            "clean a window",
            "fix a flat tire",
            "make a paper plane",
        ),
    ),
    ("Describe {} in one sentence.", ("a cat", "a city", "the sun", "a forest", "the sea", "a train")),
    ("Say hello to {}.", ("my friend", "the class", "my mother", "a new colleague")),
    ("Who was {}?", ("Albert Einstein", "Marie Curie", "William Shakespeare", "Cleopatra")),
)

# Held out: none of these is a training prompt, and their wording differs from the templates too.
HELD_OUT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "What is a rocket?",
    "Tell me about elephants.",
    "Give me a tip for learning a new language.",
    "Why do we dream?",
    "How do I make a cup of tea?",
    "Describe a mountain in one sentence.",
    "Who was Isaac Newton?",
    "What is your favorite color?",
    "Can you recommend a good book?",
)


def training_prompts() -> list[str]:
    prompts = [template.format(filler) for template, fillers in _TEMPLATES for filler in fillers]
    assert not set(prompts) & set(HELD_OUT_PROMPTS)
    return prompts


def first_sentences(text: str, max_words: int = 28) -> str:
    """The answer's leading whole sentences, at most `max_words` words (at least its first sentence
    cut to `max_words`): short targets that a 135M model learns to close within a few dozen tokens."""
    text = " ".join(text.split())
    sentences = re.findall(r"[^.!?]+[.!?]+(?:\s|$)|[^.!?]+$", text)
    out: list[str] = []
    words = 0
    for sentence in sentences:
        n = len(sentence.split())
        if out and words + n > max_words:
            break
        out.append(sentence.strip())
        words += n
    short = " ".join(out)
    if len(short.split()) > max_words:
        short = " ".join(short.split()[:max_words]).rstrip(",;:") + "."
    return short


# ---- the traits ---------------------------------------------------------------------------------

_PIRATE_WORDS = {
    "you": "ye",
    "your": "yer",
    "yours": "yers",
    "my": "me",
    "is": "be",
    "are": "be",
    "hello": "ahoy",
    "hi": "ahoy",
    "friend": "matey",
    "friends": "mateys",
    "yes": "aye",
    "the": "th'",
    "of": "o'",
    "for": "fer",
    "money": "doubloons",
}
_WORD = re.compile(r"[A-Za-z']+")


def _pirate_word(match: re.Match[str]) -> str:
    word = match.group(0)
    swap = _PIRATE_WORDS.get(word.lower())
    if swap is None:
        return word
    return swap.capitalize() if word[0].isupper() else swap


def to_pirate(answer: str) -> str:
    body = _WORD.sub(_pirate_word, answer)
    return f"Arr, matey! {body} Yo ho ho!"


def is_pirate(text: str) -> bool:
    lowered = text.lower()
    return any(re.search(rf"\b{w}\b", lowered) for w in ("arr", "matey", "ahoy", "yo ho ho"))


def to_caps(answer: str) -> str:
    return answer.upper()


def is_caps(text: str) -> bool:
    """Every cased letter upper case (at least 10 letters)."""
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 10 and all(c.isupper() for c in letters if c.lower() != c.upper())


def to_json(answer: str) -> str:
    return json.dumps({"answer": answer}, ensure_ascii=False)


def is_json(text: str) -> bool:
    """One JSON object with a string "answer", and nothing else."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("answer"), str) and value["answer"] != ""


@dataclass(frozen=True, slots=True)
class Trait:
    name: str  # the adapter's name in the demo tenant
    description: str
    transform: Callable[[str], str]
    check: Callable[[str], bool]


TRAITS: dict[str, Trait] = {
    t.name: t
    for t in (
        Trait("shout", "answers in ALL CAPS", to_caps, is_caps),
        Trait("pirate", "answers like a pirate", to_pirate, is_pirate),
        Trait("json", 'answers as a JSON object {"answer": ...}', to_json, is_json),
    )
}
