"""A slow gateway slows the audit down, never voids it (issue 14, item 8).

The sandbox's providers here generate two requests at a time and queue the rest
(``max_concurrent``), as a loaded machine does; the audit asks for 256 in flight with a
short request timeout. Before: every probe was sent at once, most waited in the queue past
the timeout (and again on each retry, behind the abandoned ones the provider still
generated), and the providers came out ``inconclusive`` on failed requests. Now the limit
halves on each timeout, timed-out probes are retried under it, and every probe is used."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from fixtures.audits import audit_at, verdicts_by_tag
from fixtures.project import Project
from fixtures.sandbox import AUTH, roster_dict
from fixtures.sandbox import provider as roster_provider

from quanthunt.sandbox.server import SandboxProcess

PROMPTS = 12


def test_a_gateway_that_queues_slows_the_audit_but_every_probe_is_used(
    project: Project, latency_sandbox: Callable[..., SandboxProcess]
) -> None:
    slow = {"latency_ms": 400, "max_concurrent": 2}
    sandbox = latency_sandbox(
        roster_dict(roster_provider("alpha", **slow), roster_provider("beta", supports_logprobs=False, **slow))
    )
    params = {
        "verify.probes.prompts": PROMPTS,
        "verify.max_probes_per_provider": PROMPTS,  # one round: mechanics, not power
        "verify.probes.max_tokens": 8,
        "verify.decision.mixture_detection_tokens": 8,
        "verify.concurrency": 256,
        "verify.request_timeout_s": 1.0,  # + 8 tokens at 10/s: 1.8 s; the queue is ~9 s deep
    }
    done = audit_at(project, sandbox, params)
    assert done.returncode == 0, done.stderr
    by_tag = verdicts_by_tag(project)
    alpha, beta = by_tag["alpha/int4"], by_tag["beta/int4"]
    assert "failed" not in alpha["reason"], alpha["reason"]
    assert "failed" not in beta["reason"], beta["reason"]
    for audited, asked in ((alpha, PROMPTS), (beta, 3 * PROMPTS)):
        assert audited["completions"] == asked and audited["failed_requests"] == 0, audited
        assert audited["unusable"] == {}, audited
    timeouts = alpha["errors"].get("timeout", 0) + beta["errors"].get("timeout", 0)
    assert timeouts > 0, "the queue never made a request time out: the test no longer tests a slow gateway"
    # Each timeout was sent and may have been generated and billed: counted, not hidden.
    assert alpha["possibly_billed"] + beta["possibly_billed"] == timeouts
    stats = httpx.get(f"{sandbox.api_url}/sandbox/stats", headers=AUTH).json()
    # each probe once, alpha's two at the generation's temperature, plus one retry per timeout
    assert stats["requests"] == PROMPTS * 4 + alpha["logprobs_reading"]["asked"] + timeouts
    said = done.stdout + done.stderr
    assert "timed out" in said and "limit" in said  # the console says why the audit slowed down
