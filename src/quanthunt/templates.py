"""The chat template the reference deployment renders, recovered from its renders, and
the prompt fidelity check: does the reference's template reproduce the prompts the
providers billed?

A trainer re-renders the final file's conversations to find what to train on. SpecForge
(``specforge/data/parse.py``, ``GeneralParser``) renders with the tokenizer's own chat
template after inserting its configured ``ChatTemplate.system_prompt`` where the data
has no system message, and trains on every span from ``assistant_header`` up to and
including ``end_of_turn_token``. Its built-in templates insert their own system prompt
(``qwen``: "You are a helpful assistant."), so a conversation the provider rendered with
the model's default system prompt is trained on a prompt it never saw. What reproduces
the provider's prompts is the model's own default system prompt and markers; they are
recovered here by rendering sentinel conversations at the reference (``render_probes``)
and comparing the texts (``derive``), so no template is assumed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from quanthunt.defaults import REFERENCE_RENDER_CONCURRENCY
from quanthunt.errors import QuanthuntError
from quanthunt.gateway import GatewayError
from quanthunt.reference import Reference, ReferenceUnusable
from quanthunt.validation import Fidelity, prompt_fidelity, requests_of

SYSTEM, USER, ANSWER, USER_2 = "QHSYSTEMSENTINEL", "QHUSERSENTINEL", "QHANSWERSENTINEL", "QHSECONDUSERSENTINEL"
PROBES: dict[str, tuple[list[dict[str, str]], bool]] = {
    "default": ([{"role": "user", "content": USER}], True),
    "with_system": ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], True),
    "answered": ([{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER}], False),
    "two_turns": ([{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER},
                   {"role": "user", "content": USER_2}], True),
}  # fmt: skip
"""Sentinel conversations and whether each is rendered with the generation prompt."""


@dataclass(frozen=True)
class ChatTemplate:
    """What SpecForge's ``ChatTemplate`` needs to render and mask as the provider rendered:
    the system prompt the model's template inserts when a conversation has none (None:
    it inserts nothing), and the markers around turns."""

    system_prompt: str | None
    user_header: str
    assistant_header: str
    end_of_turn_token: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def name(self, model: str) -> str:
        """A registry name for it: the model's slug and the fields' hash."""
        slug = re.sub(r"[^a-z0-9]+", "-", model.lower().rsplit("/", 1)[-1]).strip("-")
        return f"quanthunt-{slug}-{self.sha256[:8]}"

    def specforge(self, model: str) -> dict[str, Any]:
        """The lines a user pastes to train on the file with SpecForge: the template to
        register (Python, before training starts) and the config line that selects it."""
        name = self.name(model)
        fields = ", ".join(f"{k}={v!r}" for k, v in asdict(self).items())
        return {
            "register": "from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate\n"
            f"TEMPLATE_REGISTRY.register(name={name!r}, template=ChatTemplate({fields}))",
            "config": f"data:\n  chat_template: {name}",
        }


def _between(text: str, start: str, end: str) -> str | None:
    i = text.find(start)
    j = text.find(end, i + len(start)) if i >= 0 else -1
    return text[i + len(start) : j] if j >= 0 else None


def derive(renders: Mapping[str, str]) -> ChatTemplate:
    """The template behind ``renders`` (``PROBES``' names → rendered text); ``ValueError``
    naming what does not fit a template with one system prompt, turn headers and an
    end-of-turn marker."""
    with_system, default = renders["with_system"], renders["default"]
    at = with_system.find(SYSTEM)
    if at < 0:
        raise ValueError("the template drops a conversation's system message")
    before, after = with_system[:at], with_system[at + len(SYSTEM) :]
    system_prompt = None
    if default.startswith(before) and default.endswith(after) and len(default) >= len(before) + len(after):
        system_prompt = default[len(before) : len(default) - len(after)]
    answered = renders["answered"]
    end = answered.rfind(ANSWER)
    end_of_turn = answered[end + len(ANSWER) :] if end >= 0 else ""
    if not end_of_turn:
        raise ValueError("the template puts no end-of-turn marker after an answer")
    two = renders["two_turns"]
    after_user = _between(two, USER, ANSWER)
    after_answer = _between(two, ANSWER, USER_2)
    if after_user is None or after_answer is None or not after_answer.startswith(end_of_turn):
        raise ValueError("the template does not close an answer with the same marker inside a conversation")
    assistant_header = after_user.removeprefix(end_of_turn)
    if not assistant_header or not default.endswith(assistant_header):
        raise ValueError("the generation prompt is not the assistant header")
    return ChatTemplate(system_prompt, after_answer[len(end_of_turn) :], assistant_header, end_of_turn)


async def render_probes(reference: Reference, template_kwargs: Mapping[str, Any] | None) -> dict[str, str]:
    """Render ``PROBES`` at the reference (token ids, then their text)."""
    renders = {}
    for name, (messages, generation_prompt) in PROBES.items():
        ids = await reference.tokenize_chat(messages, template_kwargs=template_kwargs, add_generation_prompt=generation_prompt)
        renders[name] = await reference.detokenize(ids)
    return renders


async def reference_template(reference: Reference, template_kwargs: Mapping[str, Any] | None) -> ChatTemplate | str:
    """The reference's chat template, or why it could not be recovered."""
    try:
        return derive(await render_probes(reference, template_kwargs))
    except (ValueError, ReferenceUnusable, GatewayError) as exc:
        return f"the reference's chat template could not be recovered: {exc}"


async def count_prompts(
    reference: Reference,
    records: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any] | None,
    *,
    concurrency: int = REFERENCE_RENDER_CONCURRENCY,
) -> dict[tuple[str, int], int]:
    """(record id, turn) → the token count of that turn's request rendered by the
    reference's chat template, for every assistant turn of ``records`` (final rows)."""
    limit = asyncio.Semaphore(concurrency)
    counts: dict[tuple[str, int], int] = {}

    async def render(key: tuple[str, int], messages: list[dict[str, str]]) -> None:
        async with limit:
            counts[key] = len(await reference.tokenize_chat(messages, template_kwargs=template_kwargs))

    try:
        async with asyncio.TaskGroup() as group:
            for record in records:
                for k, messages in enumerate(requests_of(record["conversations"])):
                    group.create_task(render((str(record["id"]), k), messages))
    except ExceptionGroup as failed:
        # A reference that cannot be reached fails every render the same way: say it once, as
        # verify and generate do, instead of a traceback of the whole group.
        if all(isinstance(exc, QuanthuntError) for exc in failed.exceptions):
            raise failed.exceptions[0] from None
        raise
    return counts


@dataclass(frozen=True)
class PromptCheck:
    """The prompt fidelity of a final file and the template that reproduces it."""

    fidelity: Fidelity
    template: ChatTemplate | str
    """The reference's template, or why it could not be recovered."""
    model: str
    """The reference's served model."""

    def card(self) -> dict[str, Any]:
        """The card's ``prompts`` section: the match share, and what to configure a trainer with."""
        section: dict[str, Any] = {"rendered_by": self.model, **self.fidelity.card()}
        if isinstance(self.template, str):
            return section | {"chat_template": None, "why": self.template}
        return section | {
            "chat_template": {"name": self.template.name(self.model), "sha256": self.template.sha256, **asdict(self.template)},
            "specforge": self.template.specforge(self.model),
        }


async def check_prompts(
    base_url: str, model: str | None, records: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None
) -> PromptCheck:
    """Render every exported turn's request and the sentinel probes at the reference."""
    async with Reference(base_url, model=model) as reference:
        template = await reference_template(reference, template_kwargs)
        counts = await count_prompts(reference, records, template_kwargs)
        served = await reference.model_id()
    return PromptCheck(prompt_fidelity(records, counts), template, served)
