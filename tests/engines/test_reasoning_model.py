"""A reasoning model (the sandbox's reasoning profile on the default roster, as Kimi K2.5
thinks before it answers), verified both ways a user may choose (``reasoning.mode``):
thinking off on both sides, or reasoning + end of thinking + answer teacher-forced as one
stream. Every provider must be judged as with a plain model, and generation must write no
empty answer. Long (two default-roster audits on the real model): ``make test-engines``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from fixtures.audits import assert_true_to_the_default_roster, audit
from fixtures.project import Project

from quanthunt.sandbox.roster import default_roster_path

pytestmark = pytest.mark.engines

OPEN_ENDED = Path(__file__).parent / "open_ended"
"""Open-ended prompts (30 a dataset: the sample files' records before they were all made
short-answer), in place of the project's sample prompts."""


@pytest.fixture
def reasoning_project(project: Project) -> Project:
    roster = yaml.safe_load(default_roster_path().read_text())
    roster.setdefault("model", {})["reasoning"] = {"think_tokens": 12, "open": "<think>\n", "close": "</think>\n"}
    (project.root / "reasoning.yaml").write_text(yaml.safe_dump(roster))
    project.set_param("sandbox.roster", "reasoning.yaml")
    project.set_param("reasoning.end_marker", "</think>\n")
    project.set_param("reasoning.template_kwargs", {"thinking": False})
    # The audit probes open-ended prompts only: short-answer prompts (every sample record)
    # draw empty thinking-off completions from the sandbox's reasoning profile (2 of 36
    # probes of a faithful endpoint, 5 of 12 of the substitute in one audit), which verify
    # counts as failed; this suite compares the two reasoning modes, not prompts.
    for path in (project.root / "data/prompts").glob("*.jsonl"):
        shutil.copyfile(OPEN_ENDED / path.name, path)
    project.set_param("generate.max_records", 10)
    return project


@pytest.mark.parametrize("mode", ["off", "on"])
def test_every_provider_is_judged_correctly_and_no_empty_answer_is_written(reasoning_project: Project, mode: str) -> None:
    project = reasoning_project
    project.set_param("reasoning.mode", mode)
    assert_true_to_the_default_roster(audit(project, f"reasoning.mode {mode}"))

    done = project.run("generate", "chat", "--params", "params.yaml", timeout=1800)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (project.root / "data/generated/chat.jsonl").read_text().splitlines()]
    assert records
    for record in records:
        for turn in record["conversations"]:
            if turn["role"] == "assistant":
                assert turn["content"].strip(), record["id"]
                assert bool(turn.get("reasoning_content")) == (mode == "on"), record["id"]
