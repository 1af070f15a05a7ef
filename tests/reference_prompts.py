"""The prompts of the greedy identity tests: chat and raw, short and 500+ tokens. Shared by the test and
by scripts/make_reference_fixtures.py, which records transformers' greedy output for them."""

from __future__ import annotations

from typing import Any

_FACTS = [
    "The river rose slowly through the night, and by morning the lower fields were under water.",
    "Engineers measured the bridge twice a year, noting every crack in a small leather notebook.",
    "A library in the old town kept maps that were older than the town's oldest church.",
    "Bread rises because yeast turns sugar into gas, which the gluten traps in tiny pockets.",
    "The committee met on Tuesdays, argued for an hour, and then agreed with the chairwoman.",
    "Copper roofs turn green over decades as the metal reacts with air and rain.",
    "In winter the harbour froze at the edges, and children skated where boats had moored.",
    "The telescope revealed four moons circling the planet, each casting its own small shadow.",
    "Farmers rotated their crops so that the soil could recover the nitrogen it had lost.",
    "She wrote letters every Sunday, sealing each with red wax and a stamp of a heron.",
    "The train left at dawn, crossed two mountain passes, and arrived after dark.",
    "Bees communicate the direction of flowers through a dance performed inside the hive.",
]


def long_text(num_sentences: int, shift: int) -> str:
    sentences = [_FACTS[(i * 5 + shift) % len(_FACTS)] for i in range(num_sentences)]
    paragraphs = [" ".join(sentences[i : i + 4]) for i in range(0, len(sentences), 4)]
    return "\n\n".join(paragraphs)


def reference_cases() -> list[dict[str, Any]]:
    """Each case has a `name` and either `messages` (chat template) or a raw `prompt`."""
    chat_questions = [
        "What is the capital of France?",
        "Write a short poem about the sea.",
        "Explain photosynthesis in simple terms for a child who is ten years old.",
        "List three uses of Python.",
        "Why is the sky blue?",
        "Give me a recipe for pancakes.",
        "Summarize the plot of Romeo and Juliet.",
        "How do airplanes fly?",
    ]
    cases: list[dict[str, Any]] = [
        {"name": f"chat-short-{i}", "messages": [{"role": "user", "content": q}]}
        for i, q in enumerate(chat_questions)
    ]
    cases += [
        {
            "name": "chat-system",
            "messages": [
                {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
                {"role": "user", "content": "What does a compiler do?"},
            ],
        },
        {
            "name": "chat-multi-turn",
            "messages": [
                {"role": "user", "content": "Name a large animal."},
                {"role": "assistant", "content": "An elephant is a large animal."},
                {"role": "user", "content": "Where does it live?"},
            ],
        },
    ]
    raw_prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "1, 2, 3, 4, 5,",
        "The quick brown fox",
        "Water boils at",
        "Dear Sir or Madam,\nI am writing to",
        "import numpy as np\n\n",
    ]
    cases += [{"name": f"raw-short-{i}", "prompt": p} for i, p in enumerate(raw_prompts)]
    for i, n in enumerate((26, 40, 60)):
        text = long_text(n, shift=i)
        cases.append(
            {
                "name": f"chat-long-{i}",
                "messages": [{"role": "user", "content": f"Summarize this text:\n\n{text}"}],
            }
        )
        cases.append({"name": f"raw-long-{i}", "prompt": f"{long_text(n, shift=i + 3)}\n\nIn summary,"})
    return cases


def raw_reference_cases() -> list[dict[str, Any]]:
    """The raw-prompt cases, for models without a chat template (Gemma 3 270M, a base model). The long
    ones (about 600 to 1400 tokens) run past a 512-token sliding window."""
    cases = [c for c in reference_cases() if "prompt" in c and not c["name"].startswith("raw-long-")]
    for i, n in enumerate((34, 50, 80)):
        cases.append({"name": f"raw-long-{i}", "prompt": f"{long_text(n, shift=i + 3)}\n\nIn summary,"})
    return cases
