"""The validate stage's work without the stage: reading a generated dataset with what it
must agree with (verdicts, real ledger in SQLite), the clear errors when one of them is
missing or damaged, the metrics report, the final file and the provenance card (against
a real MLflow store in tmp_path)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from fixtures.params import SHIPPED, changed
from fixtures.verdicts import provider_verdict, verdicts_of

from quanthunt.errors import ConfigError
from quanthunt.export import (
    HEADLINE,
    check_dataset,
    failed,
    final_text,
    provenance_card,
    read_inputs,
    report,
    sha256_file,
    verified_sampling,
)
from quanthunt.jobs import dataset_params_hash
from quanthunt.ledger import FinishAttempt, RequestKey, StartAttempt, WriteRecords
from quanthunt.ledger_sqlite import SqliteLedger
from quanthunt.params import Params, section_digest
from quanthunt.templates import PromptCheck
from quanthunt.tracking import stage_run
from quanthunt.validation import prompt_fidelity
from quanthunt.verdicts import LogprobsReading, Verdicts

PARAMS: Params = SHIPPED.model_copy(update={"datasets": ("chat", "code")})
HASH = dataset_params_hash(PARAMS)
PATHS = PARAMS.paths
COST = 0.0125
"""What each generated record cost (one turn), in the file and in the ledger alike."""


def record(record_id: str, tag: str = "alpha/int4", finish: str = "stop") -> dict[str, Any]:
    """A generated record of one turn, served by ``tag``, as the generate stage writes it."""
    provider = tag.split("/", maxsplit=1)[0].capitalize()
    turn = {"provider": provider, "endpoint_tag": tag, "declared_quantization": "int4", "verdict": "equivalent",
            "verification_run_id": "verify-run", "verdict_run_id": None, "generation_id": f"gen-{record_id}",
            "finish_reason": finish, "prompt_tokens": 9, "completion_tokens": 4, "cost_usd": COST, "attempts": 1,
            "monitor": None}  # fmt: skip
    conversation = [{"role": "user", "content": f"question {record_id}?"},
                    {"role": "assistant", "content": f"answer to {record_id}"}]  # fmt: skip
    usage = {"prompt_tokens": 9, "completion_tokens": 4, "cost_usd": COST}
    provenance = {"providers": [provider], "usage": usage, "params_sha256": HASH, "turns": [turn]}
    return {"id": record_id, "dataset": "chat", "conversations": conversation, "provenance": provenance}


def write_verdicts(root: Path, verdicts: Verdicts | dict[str, Any]) -> Path:
    path = root / PATHS.verdicts
    path.parent.mkdir(parents=True, exist_ok=True)
    data = verdicts.model_dump(mode="json") if isinstance(verdicts, Verdicts) else verdicts
    path.write_text(json.dumps(data))
    return path


def generated(root: Path, records: list[dict[str, Any]], *, params_hash: str = HASH) -> list[str]:
    """Write ``records`` as the generate stage does: the prompts, the published file, and
    each record's attempt and written line in the ledger; the lines written."""
    files = PATHS.of(root, "chat")
    lines = [json.dumps(r) for r in records]
    for path, text in ((files.prompts, "".join(json.dumps({"id": r["id"], "messages": r["conversations"][:1]}) + "\n"
                                               for r in records)),
                       (files.generated, "".join(line + "\n" for line in lines))):  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    ledger = SqliteLedger(root / "state/ledger.sqlite")
    for r in records:
        key = RequestKey("chat", r["id"], 0, params_hash)
        attempt = ledger.write(StartAttempt(key, run_id="generate-run", reserved_usd=0.1))
        ledger.write(FinishAttempt(key, attempt, state="done", outcome="ok", cost_usd=COST))
    ledger.write(WriteRecords("chat", params_hash, [(r["id"], line, hashlib.sha256(line.encode()).hexdigest())
                                                    for r, line in zip(records, lines, strict=True)]))  # fmt: skip
    ledger.close()
    return lines


VERDICTS = verdicts_of(provider_verdict("alpha/int4", mlflow_run_id="alpha-run"), provider_verdict("beta/int4", "different"),
                       provider_verdict("gamma/int4"))  # fmt: skip
"""Alpha and gamma verified equivalent, beta not."""


def project(root: Path, records: list[dict[str, Any]]) -> Path:
    """A project with ``records`` generated for chat, the verdicts and the ledger."""
    write_verdicts(root, VERDICTS)
    generated(root, records)
    return root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Three chat records served by alpha."""
    return project(tmp_path, [record("r1"), record("r2"), record("r3")])


# -- reading the inputs ------------------------------------------------------------------


def test_inputs_hold_the_lines_the_eligible_endpoints_and_the_ledgers_view(root: Path) -> None:
    inputs = read_inputs(PARAMS, root, "chat")
    assert [json.loads(line)["id"] for line in inputs.lines] == ["r1", "r2", "r3"]
    assert sorted(inputs.eligible) == ["alpha/int4", "gamma/int4"]
    assert inputs.params_hash == HASH and inputs.costs == pytest.approx({"r1": COST, "r2": COST, "r3": COST})
    assert {r: sha for r, (sha, _) in inputs.recorded.items()} == {
        r: hashlib.sha256(line.encode()).hexdigest() for r, line in zip(["r1", "r2", "r3"], inputs.lines, strict=True)
    }


def test_records_of_other_sampling_params_are_not_this_datasets(tmp_path: Path) -> None:
    generated(tmp_path, [record("r1"), record("old")], params_hash="f" * 64)
    project(tmp_path, [record("r1"), record("r2")])  # generated again under the current params
    inputs = read_inputs(PARAMS, tmp_path, "chat")
    assert sorted(inputs.recorded) == ["r1", "r2"] and inputs.costs == pytest.approx({"r1": COST, "r2": COST})


def test_a_missing_generated_dataset_says_which_command_makes_it(root: Path) -> None:
    with pytest.raises(ConfigError) as info:
        read_inputs(PARAMS, root, "code")
    expected = "generated dataset not found; run `quanthunt generate code` first"
    assert str(info.value) == f"{root / 'data/generated/code.jsonl'}: {expected}"


def test_missing_verdicts_are_named(root: Path) -> None:
    (root / PATHS.verdicts).unlink()
    with pytest.raises(ConfigError, match=rf"^{root / PATHS.verdicts}: verdicts file not found"):
        read_inputs(PARAMS, root, "chat")


def test_verdicts_that_make_a_different_endpoint_eligible_are_refused_naming_the_file(root: Path) -> None:
    data = VERDICTS.model_dump(mode="json")
    data["providers"][1]["eligible"] = True  # beta: "different", yet eligible
    path = write_verdicts(root, data)
    with pytest.raises(ConfigError) as info:
        read_inputs(PARAMS, root, "chat")
    message = str(info.value)
    assert message.startswith(f"{path}: eligible_only_if_equivalent on provider: 1 failing (Beta"), message


def test_a_damaged_ledger_record_is_refused_naming_the_ledger(root: Path) -> None:
    ledger = SqliteLedger(root / "state/ledger.sqlite")
    ledger.db.execute("UPDATE records SET line_sha256='not a digest' WHERE record_id='r2'")
    ledger.close()
    with pytest.raises(ConfigError) as info:
        read_inputs(PARAMS, root, "chat")
    message = str(info.value)
    assert message.startswith(f"{root / 'state/ledger.sqlite'}: ") and "line_sha256" in message and "r2" in message, message


# -- checking and reporting --------------------------------------------------------------


def test_a_clean_dataset_passes_with_the_headline_figures(root: Path) -> None:
    checked = check_dataset(read_inputs(PARAMS, root, "chat"), PARAMS)
    assert checked.ok, [f.line() for f in checked.failures]
    metrics = report(checked)
    assert list(metrics) == ["status", *HEADLINE, "failures"]
    assert metrics["status"] == "passed" and metrics["records"] == 3 and metrics["failures"] == []
    assert metrics["cost_usd"] == pytest.approx(3 * COST)


def test_a_line_edited_after_generation_fails_naming_the_record_and_the_report(root: Path) -> None:
    path = PATHS.of(root, "chat").generated
    path.write_text(path.read_text().replace("answer to r2", "a better answer to r2"))
    inputs = read_inputs(PARAMS, root, "chat")
    checked = check_dataset(inputs, PARAMS)
    metrics = report(checked)
    assert metrics["status"] == "failed"
    assert metrics["failures"] == [{"column": "line_sha256", "check": "edited_after_generation", "count": 1, "examples": ["r2"]}]
    message = str(failed(inputs, checked))
    assert message == (
        "validation of chat failed 1 check(s); first: edited_after_generation on line_sha256: 1 failing (r2); "
        f"see {root / 'reports/validate/chat.json'} (the previous final file is untouched)"
    )


def test_a_record_served_by_an_endpoint_not_verified_equivalent_fails(tmp_path: Path) -> None:
    project(tmp_path, [record("r1"), record("r2", tag="beta/int4")])
    checked = check_dataset(read_inputs(PARAMS, tmp_path, "chat"), PARAMS)
    assert [(f.check, f.count) for f in checked.failures] == [("served_by_verified_equivalent_provider", 1)]
    assert checked.failures[0].examples[0].startswith("r2")


def test_the_final_file_is_one_json_row_per_line(root: Path) -> None:
    checked = check_dataset(read_inputs(PARAMS, root, "chat"), PARAMS)
    text = final_text(checked)
    assert text.endswith("\n") and [orjson.loads(line) for line in text.splitlines()] == checked.records
    assert [row["id"] for row in checked.records] == ["r1", "r2", "r3"]
    assert all(row["status"] == "success" and row["provenance"]["dataset"] == "chat" for row in checked.records)


def test_sha256_file_reads_past_its_chunk_size(tmp_path: Path) -> None:
    data = bytes(range(256)) * (5 * 4096 + 7)  # 5 MiB and a bit: several reads
    (tmp_path / "big.bin").write_bytes(data)
    assert sha256_file(tmp_path / "big.bin") == hashlib.sha256(data).hexdigest()


# -- the provenance card -----------------------------------------------------------------


@pytest.fixture
def tracked(tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """An MLflow store in ``tmp_path`` with a generate run of chat and one of code; the chat run's id."""
    for name in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", "QUANTHUNT_PIPELINE_ID"):
        monkeypatch.delenv(name, raising=False)
    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    ids = []
    for dataset in ("chat", "code"):
        with stage_run("generate", params=PARAMS, section=PARAMS.generate, root=tmp_path,
                       experiment=PARAMS.tracking.experiment) as run:  # fmt: skip
            run.set_tags({"dataset": dataset})
            ids.append(run.run_id)
    return ids[:1]


def test_the_card_says_what_the_final_file_is_and_where_each_record_came_from(tmp_path: Path, tracked: list[str]) -> None:
    root = project(tmp_path, [record("r1"), record("r2", finish="length"), record("r3", tag="gamma/int4")])
    params = PARAMS.model_copy(update={"validate_": changed(PARAMS.validate_, max_truncated_share=0.5, unfinished="drop")})
    inputs = read_inputs(params, root, "chat")
    checked = check_dataset(inputs, params)
    assert checked.ok, [f.line() for f in checked.failures]
    final = final_text(checked)
    prompts = PromptCheck(prompt_fidelity(checked.records, {("r1", 0): 9}), "no template: test", "the-reference")
    card = provenance_card(inputs, checked, params, prompts, final=final, validate_run_id="validate-run")

    files = PATHS.of(root, "chat")
    assert card["digests"] == {
        "prompts_sha256": hashlib.sha256(files.prompts.read_bytes()).hexdigest(),
        "generated_sha256": hashlib.sha256(files.generated.read_bytes()).hexdigest(),
        "final_sha256": hashlib.sha256(final.encode()).hexdigest(),
    }
    assert (card["dataset"], card["records"], card["records_generated"]) == ("chat", 2, 3)
    assert card["removed"]["records_dropped"] == 1 and card["removed"]["turns_by_finish_reason"] == {"length": 1}
    assert card["cost_usd"] == pytest.approx(3 * COST) and card["removed"]["cost_usd"] == pytest.approx(COST)
    served = {p["tag"]: (p["records_served"], p["verdict"], p["verdict_run_id"]) for p in card["providers"]}
    assert served == {"alpha/int4": (2, "equivalent", "alpha-run"), "gamma/int4": (1, "equivalent", None)}
    assert card["params_sha256"] == {"generation": HASH, "validate": section_digest(params.validate_),
                                     "verify": VERDICTS.params_sha256}  # fmt: skip
    assert card["params_sha256"]["validate"] != section_digest(PARAMS.validate_)
    assert card["mlflow"] == {"validate_run_id": "validate-run", "verification_run_id": "verify-run",
                              "generation_run_ids": tracked}  # fmt: skip
    assert card["git"] == {"commit": None, "dirty": False}  # tmp_path is no git repository
    assert card["prompts"]["rendered_by"] == "the-reference" and card["prompts"]["turns_matched"] == 1
    assert card["model"] == PARAMS.survey.model and card["checks"]["passed"] is True
    json.dumps(card)  # written as JSON beside the final file


def test_the_card_says_what_the_audit_did_not_verify_of_the_sampling() -> None:
    """Issue 25 §4: the audit samples at temperature 1, top-p 1. At the shipped 0.7 the
    monitor tests every provider's sampler at 0.7 (the tempered rank); under a nucleus cut
    or with the monitor off, the card must not let the dataset pass for verified at its own
    sampling, and names the sample-mode providers nothing watched."""
    providers = [provider_verdict("alpha/int4"), provider_verdict("novita/int4", mode="sample")]
    warm = verified_sampling(PARAMS, providers)
    assert warm["audit"] == {"temperature": 1.0, "top_p": 1.0, "max_tokens": PARAMS.verify.probes.max_tokens}
    assert warm["generation"]["temperature"] == PARAMS.generate.sampling.temperature == 0.7
    assert warm["differs"] == ["temperature"] and warm["not_monitored"] == []
    assert "The monitor tests each monitored reply's sampler at temperature 0.7" in warm["note"]
    assert "Not verified" not in warm["note"]

    def sampled_at(temperature: float, top_p: float, share: float = 0.05) -> Params:
        sampling = changed(PARAMS.generate.sampling, temperature=temperature, top_p=top_p)
        monitor = changed(PARAMS.generate.monitor, share=share)
        return PARAMS.model_copy(update={"generate": PARAMS.generate.model_copy(update={"sampling": sampling,
                                                                                          "monitor": monitor})})  # fmt: skip

    nucleus = verified_sampling(sampled_at(1.0, 0.9), providers)
    assert nucleus["differs"] == ["top_p"] and "top-p 0.9" in nucleus["note"] and nucleus["not_monitored"] == ["novita/int4"]
    assert "Not verified: that each provider applies this temperature and top-p" in nucleus["note"]
    unwatched = verified_sampling(sampled_at(0.7, 1.0, share=0.0), providers)
    assert unwatched["not_monitored"] == ["novita/int4"] and "Not verified" in unwatched["note"]
    raw = verified_sampling(sampled_at(1.0, 1.0), providers)
    assert raw["differs"] == [] and raw["not_monitored"] == [] and "Not verified" not in raw["note"]


def test_the_card_names_providers_whose_logprobs_read_after_temperature() -> None:
    """Issue 25 §4: verify reads each logprob-mode provider's convention at the generation's
    temperature; the card names those read as processed, and any read at another temperature
    than the dataset was generated at (params changed since the audit)."""

    def reading(read_as: str, temperature: float = 0.7) -> LogprobsReading:
        return LogprobsReading(temperature=temperature, read_as=read_as, slopes=[1.43], replies=2, asked=2)  # type: ignore[arg-type]

    providers = [
        provider_verdict("alpha/int4", logprobs_reading=reading("raw")),
        provider_verdict("beta/int4", logprobs_reading=reading("processed")),
        provider_verdict("novita/int4", mode="sample"),
    ]
    said = verified_sampling(PARAMS, providers)
    assert said["logprobs_read_as"] == {"alpha/int4": "raw", "beta/int4": "processed"}
    assert "Logprobs reported after temperature (read so, against the reference's tempered logprobs): beta/int4" in said["note"]
    assert "another temperature" not in said["note"]
    providers[0] = provider_verdict("alpha/int4", logprobs_reading=reading("raw", temperature=0.5))
    stale = verified_sampling(PARAMS, providers)
    assert "at another temperature than generation's 0.7: alpha/int4" in stale["note"]
