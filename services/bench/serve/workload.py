"""The workloads of `kvrelay bench serve`: seeded jobs, each one request or a multi-turn conversation.

Every text is made here from fixed word lists and `--seed`, so the same flags give the same requests
against any server (ours or a peer's); no tokenizer is needed. Kinds of job:
- `qa`: a shared short system prompt and one short question;
- `summary`: "summarize this document", over one of DOC_POOL long documents (so repeats share a prefix);
- `multiturn`: a conversation of `turns` turns: a mid-sized opening message, then short follow-ups, each
  turn's prompt the whole conversation so far (the replies included), sent after the previous reply;
- `cancel`: a summary request that the client drops after its first text delta.

Workloads: `qa`, `summary`, `multiturn` (one kind each); `mix` (half qa, a quarter each summary and
multiturn: every block of four jobs holds two qa, one summary and one multiturn, in a seeded order);
`cancel-burst` (cancel jobs); `two-tenants` (jobs alternate between tenant 0, which sends summaries, and
tenant 1, which sends Q&A: a bulk tenant next to an interactive one).

Protocols: one for every job, or with `mix` the four in turn (job i takes PROTOCOLS[i % 4]): the first
block of four jobs (6 requests with 3 turns) covers all four.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

PROTOCOLS = ("openai-chat", "openai-completions", "responses", "anthropic")
WORKLOADS = ("qa", "summary", "multiturn", "mix", "cancel-burst", "two-tenants")
DOC_POOL = 4
MIX_BLOCK = ("qa", "qa", "summary", "multiturn")

QA_SYSTEM = "You are a helpful assistant. Answer briefly and plainly."
SUMMARY_SYSTEM = "You are a careful editor. Summarize documents faithfully and concisely."
CHAT_SYSTEM = "You are a friendly assistant who keeps track of the conversation."

QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do airplanes stay in the air?",
    "What does a compiler do?",
    "Name three uses of copper.",
    "How does yeast make bread rise?",
    "What causes the seasons on Earth?",
    "Why do cats purr?",
    "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?",
    "What is photosynthesis?",
    "Why do we have leap years?",
    "How do bees find flowers?",
    "What is a prime number?",
    "Why does ice float on water?",
    "How do vaccines work?",
)
FACTS = (
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
    "The market opened at six, and by seven the best apples had already been sold.",
    "A storm knocked out the power for two days, so the bakery baked with wood again.",
    "The museum moved its oldest clock to a quiet room where the ticking echoed.",
    "Volunteers planted a thousand trees along the road that leads to the lake.",
)
FOLLOW_UPS = (
    "Can you say more about that?",
    "Summarize that in one sentence.",
    "What is the most surprising part?",
    "Why would that happen?",
    "What should happen next?",
    "Give me one example.",
)


@dataclass(frozen=True)
class WorkloadPlan:
    workload: str = "mix"
    protocol: str = "openai-chat"  # one of PROTOCOLS, or "mix"
    doc_sentences: int = 24
    turns: int = 3
    tenants: int = 1  # labels t0..t{n-1}; two-tenants uses two whatever this says
    seed: int = 0


@dataclass
class Job:
    """One job: `turns` user messages sent one after another (one for every kind but multiturn)."""

    index: int
    kind: str
    protocol: str
    tenant: str
    system: str
    turns: list[str] = field(default_factory=list)

    @property
    def cancel_after_first_delta(self) -> bool:
        return self.kind == "cancel"


def document(index: int, num_sentences: int) -> str:
    """Document `index` of the pool: `num_sentences` facts in a fixed order per index, in paragraphs."""
    rng = random.Random(1000 + index)
    sentences = [rng.choice(FACTS) for _ in range(num_sentences)]
    paragraphs = [" ".join(sentences[i : i + 4]) for i in range(0, len(sentences), 4)]
    return f"Field report {index + 1}.\n\n" + "\n\n".join(paragraphs)


def _mix_kinds(count: int, rng: random.Random) -> list[str]:
    """MIX_BLOCK shuffled, block after block: every four jobs hold the mix's exact shares."""
    kinds: list[str] = []
    while len(kinds) < count:
        kinds += rng.sample(MIX_BLOCK, len(MIX_BLOCK))
    return kinds[:count]


def _kind(plan: WorkloadPlan, index: int, mix: list[str]) -> str:
    if plan.workload == "mix":
        return mix[index]
    if plan.workload == "cancel-burst":
        return "cancel"
    if plan.workload == "two-tenants":
        return "summary" if index % 2 == 0 else "qa"
    return plan.workload


def _tenant(plan: WorkloadPlan, index: int) -> str:
    count = 2 if plan.workload == "two-tenants" else max(1, plan.tenants)
    return f"t{index % count}"


def _job(plan: WorkloadPlan, index: int, rng: random.Random, mix: list[str]) -> Job:
    kind = _kind(plan, index, mix)
    protocol = PROTOCOLS[index % len(PROTOCOLS)] if plan.protocol == "mix" else plan.protocol
    job = Job(index, kind, protocol, _tenant(plan, index), QA_SYSTEM)
    if kind == "qa":
        job.turns = [rng.choice(QUESTIONS)]
    elif kind in ("summary", "cancel"):
        job.system = SUMMARY_SYSTEM
        doc = document(rng.randrange(DOC_POOL), plan.doc_sentences)
        job.turns = [f"Summarize the following document in a few sentences.\n\n{doc}"]
    else:
        job.system = CHAT_SYSTEM
        notes = document(DOC_POOL + rng.randrange(64), max(4, plan.doc_sentences // 3))
        follow_ups = [rng.choice(FOLLOW_UPS) for _ in range(max(0, plan.turns - 1))]
        job.turns = [f"Here are my notes:\n\n{notes}\n\nWhat stands out to you?", *follow_ups]
    return job


def build_jobs(plan: WorkloadPlan, count: int) -> list[Job]:
    """`count` jobs from `plan.seed` (enough for `count` requests: every job is at least one)."""
    rng = random.Random(plan.seed)
    mix = _mix_kinds(count, rng)
    return [_job(plan, i, rng, mix) for i in range(count)]
