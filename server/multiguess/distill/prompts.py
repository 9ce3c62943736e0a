"""A diverse, deterministic prompt set (chat, code, summarisation) for self-distillation.

The draft must predict what the target says in reply to users, so its training data are the
target's own replies to prompts of the kinds served. Prompts are built from templates crossed
with topics; the held-out split is by *topic*, so evaluation measures replies about subjects the
draft never saw in training.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TOPICS: tuple[str, ...] = (
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "machine learning",
    "climate change",
    "the immune system",
    "volcanoes",
    "the stock market",
    "democracy",
    "the water cycle",
    "quantum computing",
    "the Roman Empire",
    "vaccines",
    "renewable energy",
    "the internet",
    "plate tectonics",
    "inflation",
    "the human brain",
    "coral reefs",
    "artificial intelligence",
    "the Renaissance",
    "electric cars",
    "sleep",
    "nutrition",
    "the Moon landing",
    "DNA",
    "earthquakes",
    "the printing press",
    "honeybees",
    "supply and demand",
    "blockchain",
    "the Industrial Revolution",
    "rainforests",
    "gravity",
    "the solar system",
    "antibiotics",
    "social media",
    "meditation",
    "the Great Wall of China",
    "recycling",
    "the theory of evolution",
    "jazz music",
    "the Olympic Games",
    "coffee",
    "chess",
    "the ocean tides",
    "batteries",
    "the Cold War",
    "photography",
    "bread baking",
    "dinosaurs",
    "the heart",
    "cryptography",
    "operating systems",
    "databases",
    "compilers",
    "public speaking",
    "time management",
    "learning a new language",
    "gardening",
    "the Amazon river",
    "Mount Everest",
    "wind turbines",
    "nuclear power",
    "the periodic table",
    "friction",
    "magnetism",
    "light and color",
    "sound waves",
    "the ancient Egyptians",
    "the Vikings",
    "Shakespeare",
    "the piano",
    "football",
    "marathon running",
    "budgeting",
    "job interviews",
    "remote work",
    "cloud computing",
    "open source software",
    "the Linux kernel",
    "web browsers",
    "email",
    "smartphones",
    "3D printing",
    "robots",
    "self-driving cars",
    "space exploration",
    "Mars",
    "the speed of light",
    "rainbows",
    "snowflakes",
    "deserts",
    "glaciers",
    "hurricanes",
    "bacteria",
    "viruses",
    "the digestive system",
    "muscles",
    "exercise",
    "stress",
    "friendship",
    "kindness",
    "leadership",
    "teamwork",
    "negotiation",
    "writing an essay",
    "reading habits",
    "libraries",
    "museums",
    "architecture",
    "bridges",
    "trains",
    "airplanes",
    "ships",
    "the bicycle",
    "maps",
    "the calendar",
    "clocks",
    "money",
    "taxes",
    "insurance",
    "banks",
    "small businesses",
    "marketing",
    "customer service",
    "pizza",
    "tea",
    "chocolate",
    "cheese",
    "spices",
    "vegetarian cooking",
    "dogs",
    "cats",
    "birds",
    "whales",
    "elephants",
    "ants",
    "trees",
    "flowers",
    "mushrooms",
    "soil",
    "rivers",
    "lakes",
    "islands",
    "cities",
    "villages",
    "farming",
    "fishing",
    "weather forecasts",
    "statistics",
    "probability",
    "prime numbers",
    "geometry",
    "calculus",
    "algebra",
    "logic puzzles",
    "poetry",
    "novels",
    "movies",
    "video games",
    "board games",
    "painting",
    "sculpture",
    "dance",
    "opera",
    "human rights",
    "the United Nations",
    "elections",
    "law and courts",
    "philosophy",
    "ethics",
    "psychology",
    "memory",
    "habits",
    "motivation",
    "happiness",
    "childhood",
    "aging",
    "family",
)

CHAT_TEMPLATES: tuple[str, ...] = (
    "What is {t}?",
    "Explain {t} to a ten-year-old.",
    "Can you explain how {t} works?",
    "Give me three interesting facts about {t}.",
    "Why is {t} important?",
    "Write a short paragraph about {t}.",
    "What are the pros and cons of {t}?",
    "Tell me a short story involving {t}.",
    "Write a haiku about {t}.",
    "What are common misconceptions about {t}?",
    "How would you describe {t} in one sentence?",
    "List five questions a student might ask about {t}.",
    "What is the history of {t}?",
    "Write a short poem about {t}.",
    "How can I learn more about {t}?",
    "Compare {t} with something from everyday life.",
    "What would happen if {t} did not exist?",
    "Give me some tips related to {t}.",
    "Write a tweet about {t}.",
    "Summarize what you know about {t} in a few bullet points.",
    "What are the main parts of {t}?",
    "Write an email to a friend about {t}.",
    "I am curious about {t}. Where should I start?",
    "Describe {t} as if you were a teacher.",
)

CODE_TASKS: tuple[str, ...] = (
    "reverses a string",
    "checks whether a number is prime",
    "computes the factorial of n",
    "returns the n-th Fibonacci number",
    "counts the words in a text",
    "sorts a list of dictionaries by a key",
    "removes duplicates from a list",
    "finds the largest element in a list",
    "merges two sorted lists",
    "checks whether a string is a palindrome",
    "converts Celsius to Fahrenheit",
    "reads a CSV file",
    "counts vowels in a string",
    "flattens a nested list",
    "computes the average of a list of numbers",
    "finds the greatest common divisor of two numbers",
    "implements binary search",
    "capitalizes every word in a sentence",
    "generates a random password",
    "validates an email address",
    "computes the sum of digits of a number",
    "transposes a matrix",
    "implements a stack class",
    "implements a queue with two stacks",
    "finds all anagrams of a word in a list",
    "parses a date string",
    "counts the frequency of each character",
    "checks whether two strings are anagrams",
    "returns the second largest number in a list",
    "converts a decimal number to binary",
    "implements bubble sort",
    "implements quicksort",
    "computes the power set of a list",
    "rotates a list by k positions",
    "checks balanced parentheses",
    "finds the longest word in a sentence",
    "computes compound interest",
    "chunks a list into groups of n",
    "writes a dictionary to a JSON file",
    "downloads nothing but simulates a retry loop with backoff",
    "computes the median of a list",
    "implements a simple linked list",
    "finds the intersection of two lists",
    "checks for a leap year",
)

LANGUAGES: tuple[str, ...] = ("Python", "Python", "Python", "JavaScript", "Go", "Rust", "C", "Java", "Bash")

CODE_TEMPLATES: tuple[str, ...] = (
    "Write a {lang} function that {task}.",
    "How do I write code in {lang} that {task}?",
    "Show me a {lang} example that {task}, and explain it.",
    "Write a short {lang} program that {task}. Add comments.",
)

SNIPPET_TEMPLATES: tuple[str, ...] = (
    "Summarize the following text:\n\n{s}",
    "Give a one-sentence summary of this:\n\n{s}",
    "What is the main idea of this passage?\n\n{s}",
    "Summarize this in three bullet points:\n\n{s}",
    "Explain what this code does:\n\n{s}",
    "Rewrite this more simply:\n\n{s}",
)


@dataclass(frozen=True)
class Prompt:
    """One user message and the group it is split by (topic or source snippet)."""

    text: str
    group: str
    kind: str


def is_heldout(group: str, fraction: float) -> bool:
    """Stable split by group: the same group always lands on the same side."""
    digest = hashlib.sha256(group.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def template_prompts() -> list[Prompt]:
    """Chat prompts (template x topic) and code prompts (template x language x task)."""
    prompts = [Prompt(tpl.format(t=t), t, "chat") for t in TOPICS for tpl in CHAT_TEMPLATES]
    prompts += [
        Prompt(tpl.format(lang=lang, task=task), task, "code")
        for task in CODE_TASKS
        for lang in sorted(set(LANGUAGES))
        for tpl in CODE_TEMPLATES
    ]
    return prompts


def snippet_prompts(snippets: Iterable[str], seed: int = 0) -> list[Prompt]:
    """Summarisation / explanation prompts over local text snippets (each snippet is its own group)."""
    rng = random.Random(seed)
    return [
        Prompt(rng.choice(SNIPPET_TEMPLATES).format(s=s), hashlib.sha1(s.encode()).hexdigest(), "summary")
        for s in snippets
    ]


def split_prompts(
    prompts: Sequence[Prompt], heldout_fraction: float = 0.08, seed: int = 0
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout), each shuffled deterministically."""
    train = [p for p in prompts if not is_heldout(p.group, heldout_fraction)]
    heldout = [p for p in prompts if is_heldout(p.group, heldout_fraction)]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(heldout)
    return train, heldout
