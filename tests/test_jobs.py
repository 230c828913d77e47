"""What a generate run is asked to do: the hash that keys a dataset's records (what their
content depends on, and nothing else), endpoint weights as OpenRouter balances them, a
job's worst-case rates, and what a job reads from the params section and verdicts it
holds whole (and reads back equal from the JSON it is published as)."""

from __future__ import annotations

import json

from fixtures.params import SHIPPED, changed
from fixtures.verdicts import eligible
from pydantic import TypeAdapter

from quanthunt.gateway import Routing
from quanthunt.jobs import Eligible, Job, dataset_params_hash, params_hash
from quanthunt.params import Params

SAMPLING = {"temperature": 0.6, "top_p": 0.95, "max_tokens": 64, "seed": None}


def test_the_params_hash_keys_what_the_content_depends_on() -> None:
    base = params_hash("a/b", SAMPLING)
    assert base == params_hash("a/b", dict(reversed(list(SAMPLING.items()))))  # key order is no change
    assert base == params_hash("a/b", SAMPLING, "none")  # not a reasoning model: the hash as before modes existed
    assert len({base, params_hash("a/c", SAMPLING), params_hash("a/b", SAMPLING | {"top_p": 0.9}),
                params_hash("a/b", SAMPLING, "off"), params_hash("a/b", SAMPLING, "on")}) == 5  # fmt: skip


def test_the_dataset_hash_ignores_what_may_change_between_runs() -> None:
    shipped = dataset_params_hash(SHIPPED)

    def with_generate(**update: object) -> Params:
        return changed(SHIPPED, generate=changed(SHIPPED.generate, **update))

    assert shipped == dataset_params_hash(with_generate(concurrency=7, max_usd_per_run=1.5))
    hotter = with_generate(sampling=changed(SHIPPED.generate.sampling, temperature=0.1))
    assert shipped != dataset_params_hash(hotter)


def endpoint(tag: str, prompt: float, completion: float, context: int = 8192) -> Eligible:
    return eligible(tag, tag, "int4", prompt, completion, context)


def test_endpoints_weigh_one_over_their_price_squared_and_a_job_plans_for_the_worst() -> None:
    cheap, dear = endpoint("cheap/int4", 1e-7, 1e-7), endpoint("dear/int4", 2e-7, 2e-7, context=4096)
    assert cheap.weight / dear.weight == 4.0
    job = Job(dataset="chat", model="a/b", providers=(cheap, dear), routing=Routing(), params_hash="0" * 64, run_id="r",
              settings=SHIPPED.generate, concurrency=1, verification_run_id=None)  # fmt: skip
    assert (job.worst_prompt_rate, job.worst_completion_rate, job.context_length) == (2e-7, 2e-7, 4096)


def test_a_job_reads_its_section_and_verdicts_whole_and_round_trips_as_published() -> None:
    settings = changed(SHIPPED.generate, max_usd_per_run=2.5, max_output_tokens=1000, ramp_up_s=3.0)
    novita = eligible("Novita", "novita/int4", "int4", 1e-7, 4e-7, verdict_run_id="run-n")
    job = Job(dataset="chat", model="a/b", providers=(novita,), routing=Routing(), params_hash="0" * 64, run_id="r",
              settings=settings, concurrency=9, verification_run_id="v", reasoning={"enabled": False})  # fmt: skip
    assert (job.sampling, job.max_usd, job.max_output_tokens, job.ramp_up_s, job.retry, job.concurrency) == (
        settings.sampling, 2.5, 1000, 3.0, settings.retry, 9
    )  # fmt: skip
    assert novita.provenance() == {"provider": "Novita", "endpoint_tag": "novita/int4", "declared_quantization": "int4",
                                   "verdict": "equivalent", "verdict_run_id": "run-n"}  # fmt: skip
    published = TypeAdapter(Job)
    assert published.validate_python(json.loads(json.dumps(published.dump_python(job, mode="json")))) == job
