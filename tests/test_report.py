"""The report's pure parts on a small audit (Alpha and Beta equivalent and serving, Gamma
excluded by the survey yet audited and found different, Delta excluded and never audited):
who served what at what cost (``served``, ``cost_rows``), the CSV series ``dvc plots``
reads, the survey, served and budget sections' figures, and the whole page's structure
(every provider in its rows, each row classed and coloured by its verdict, names from the
gateway escaped, the summary's counts). The report stage end to end, its plots and Chromium
rendering are ``tests/stages/test_report_stage.py``."""

from __future__ import annotations

import csv
import dataclasses
import io
from collections import defaultdict
from html.parser import HTMLParser
from typing import Any

import pytest
from fixtures.params import SHIPPED
from fixtures.verdicts import provider_verdict, verdicts_of

from quanthunt import figures
from quanthunt.report import (
    DatasetView,
    budget_section,
    cost_rows,
    csv_text,
    json_lines,
    monitor_section,
    overview_section,
    render,
    served,
    served_section,
    survey_section,
    verification_rows,
)
from quanthunt.survey import ProviderRow, plan_budget, price_scenario
from quanthunt.verdicts import Calibration, Estimate
from quanthunt.verdicts import TestResult as HypothesisTest  # not a pytest class

MARGIN, POLICY = SHIPPED.verify.margin, SHIPPED.verify.decision
EVIL = "O'Brien <Labs> & Co"
"""A provider name as the gateway may send it: HTML must show it, not parse it."""
PLOT_COLUMNS = ["tag", "provider", "verdict", "mode", "effect", "ci_low", "ci_high"]
"""The columns the report stage writes ``reports/plots/verification.csv`` with."""


class Page(HTMLParser):
    """The rows of every table (class and cells' text) and the text, by enclosing ``<section id>``."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: dict[str, list[tuple[str, list[str]]]] = defaultdict(list)
        self.text: dict[str, str] = defaultdict(str)
        self.tags: list[str] = []
        self._sections: list[str] = []
        self._row: tuple[str, list[str]] | None = None
        self._cell: str | None = None
        self.feed(html)

    @property
    def _section(self) -> str:
        return self._sections[-1] if self._sections else ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        values = dict(attrs)
        if tag == "section":
            self._sections.append(str(values.get("id")))
        elif tag == "tr":
            self._row = (str(values.get("class") or ""), [])
        elif tag == "td":
            self._cell = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self._sections.pop()
        elif tag == "td" and self._row is not None and self._cell is not None:
            self._row[1].append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row[1]:  # not the header
                self.rows[self._section].append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        self.text[self._section] += data
        if self._cell is not None:
            self._cell += data


def turn(tag: str, *, tokens: int | None = 10, cost: float | None = 0.001) -> dict[str, Any]:
    provider = EVIL if tag == "alpha/int4" else tag.split("/", maxsplit=1)[0].capitalize()
    return {"provider": provider, "endpoint_tag": tag, "completion_tokens": tokens, "cost_usd": cost}


def record(record_id: str, *turns: dict[str, Any], answer: str = "an answer") -> dict[str, Any]:
    tokens = sum(t["completion_tokens"] or 0 for t in turns)
    conversation = [{"role": "user", "content": "a question"}, {"role": "assistant", "content": answer}]
    return {
        "id": record_id,
        "conversations": conversation,
        "provenance": {"turns": list(turns), "usage": {"completion_tokens": tokens}},
    }


CHAT = DatasetView(
    "chat",
    [
        record("r1", turn("alpha/int4", cost=0.1), turn("alpha/int4", cost=0.2)),  # one record, two turns of one endpoint
        record("r2", turn("alpha/int4", tokens=30), turn("beta/fp8", tokens=20, cost=0.004)),  # a record for each endpoint
        record("r3", turn("beta/fp8", tokens=None, cost=None)),  # usage the reply did not carry counts as none
    ],
    card={"cost_usd": 0.5, "tokens": {"completion": 4000}, "spend": {"settled_usd": 0.51, "possibly_billed_usd": 0.03}},
    validation={"status": "passed", "truncated_share": 0.0, "near_duplicate_share": 0.0},
)
CODE = DatasetView("code", [record("c1", turn("alpha/int4", tokens=5, cost=0.002))], card=None, validation=None)
DATASETS = [CHAT, CODE]

VERDICTS = verdicts_of(
    provider_verdict(
        "alpha/int4",
        provider=EVIL,
        effects={
            "mean_abs_dlogprob": Estimate(value=0.01, ci_low=0.005, ci_high=0.02),
            "mean_abs_dlogprob_clipped": Estimate(value=0.009, ci_low=0.004, ci_high=0.019),
            "mean_pit": Estimate(value=0.5, ci_low=0.44, ci_high=0.56),
        },
        tests=[
            HypothesisTest(name="tail", kind="difference", statistic=1.0, p_value=0.2, p_adjusted=0.4, null="no shift"),
            HypothesisTest(name="mean", kind="equivalence", statistic=2.0, p_value=0.03, p_adjusted=None, null="shift"),
        ],
        mlflow_run_id="run-alpha",
    ),
    provider_verdict(
        "beta/fp8", declared_quantization="fp8", mode="sample", effects={"rank_z": Estimate(value=0.1, ci_low=-0.2, ci_high=0.4)}
    ),
    provider_verdict(
        "gamma/nvfp4", "different", declared_quantization="nvfp4", survey_decision="excluded: declared nvfp4", cost_usd=0.0004
    ),
)


def surveyed(provider: str, tag: str, reason: str = "candidate", *, status: int | None = 0) -> ProviderRow:
    return ProviderRow(provider=provider, tag=tag, declared_quantization=tag.split("/")[1], prompt_usd_per_m=0.5,
                       completion_usd_per_m=2.0, discount=0.0, price_note="", status=status, uptime_last_30m=None,
                       context_length=8192, max_completion_tokens=None, supports_logprobs=tag != "beta/fp8",
                       decision="candidate" if reason == "candidate" else "excluded", reason=reason)  # fmt: skip


PROVIDERS = [
    surveyed(EVIL, "alpha/int4"),
    surveyed("Beta", "beta/fp8"),
    surveyed("Gamma", "gamma/nvfp4", "excluded: declared nvfp4"),
    surveyed("Delta", "delta/int4", "excluded: status -5", status=-5),
]


# -- who served what ---------------------------------------------------------------------------------------------------


def test_each_endpoint_is_credited_once_per_record_with_every_turn_it_served() -> None:
    alpha, beta = served(DATASETS)  # most records first
    assert (alpha.tag, alpha.provider, dict(alpha.records), alpha.turns) == ("alpha/int4", EVIL, {"chat": 2, "code": 1}, 4)
    assert alpha.output_tokens == 10 + 10 + 30 + 5
    assert alpha.cost_usd == pytest.approx({"chat": 0.301, "code": 0.002}) and alpha.cost == pytest.approx(0.303)
    assert (beta.tag, dict(beta.records), beta.turns, beta.output_tokens) == ("beta/fp8", {"chat": 2}, 2, 20)
    assert beta.cost_usd == pytest.approx({"chat": 0.004})


def test_endpoints_serving_as_many_records_are_ordered_by_tag() -> None:
    tied = DatasetView("chat", [record("x", turn("zeta/int4")), record("y", turn("eta/int4"))], None, None)
    assert [s.tag for s in served([tied])] == ["eta/int4", "zeta/int4"]


def test_cost_rows_give_each_dataset_and_endpoint_its_records_and_rounded_cost() -> None:
    assert cost_rows(DATASETS) == [
        {"dataset": "chat", "tag": "alpha/int4", "provider": EVIL, "cost_usd": 0.301, "records": 2},  # 0.1 + 0.2 + 0.001
        {"dataset": "chat", "tag": "beta/fp8", "provider": "Beta", "cost_usd": 0.004, "records": 2},
        {"dataset": "code", "tag": "alpha/int4", "provider": EVIL, "cost_usd": 0.002, "records": 1},
    ]
    assert cost_rows([]) == []


# -- the series dvc plots reads --------------------------------------------------------------------------------------------


def test_verification_rows_take_each_modes_effect_and_zero_where_none_was_measured() -> None:
    alpha, beta, gamma = verification_rows(VERDICTS)
    assert alpha == {"tag": "alpha/int4", "provider": EVIL, "verdict": "equivalent", "mode": "logprob", "effect": 0.01,
                     "ci_low": 0.005, "ci_high": 0.02}  # fmt: skip
    assert (beta["mode"], beta["effect"], beta["ci_low"], beta["ci_high"]) == ("sample", 0.1, -0.2, 0.4)  # rank z
    assert (gamma["verdict"], gamma["effect"], gamma["ci_low"], gamma["ci_high"]) == ("different", 0.0, 0.0, 0.0)


def test_the_verification_csv_reads_back_as_written_even_with_quotes_and_commas_in_names() -> None:
    rows = verification_rows(verdicts_of(provider_verdict("acme/int4", provider='Acme, "the" Co')))
    text = csv_text(rows, PLOT_COLUMNS)
    assert text.splitlines()[0] == ",".join(PLOT_COLUMNS)
    assert list(csv.DictReader(io.StringIO(text))) == [{k: str(v) for k, v in row.items()} for row in rows]


def test_json_lines_skip_blank_lines_and_keep_order() -> None:
    assert json_lines('{"id": "b"}\n\n  \n{"id": "a"}\n') == [{"id": "b"}, {"id": "a"}]
    assert json_lines("") == []


# -- the sections ------------------------------------------------------------------------------------------------------


def test_the_survey_section_tells_who_was_excluded_audited_and_served() -> None:
    page = Page(survey_section(PROVIDERS, VERDICTS, {s.tag: s for s in served(DATASETS)}))
    assert page.text[""].startswith(
        "4 endpoints surveyed; 2 candidate(s); 2 excluded by the policy (Gamma: excluded: declared nvfp4; Delta: excluded: "
        "status -5). 3 audited, 1 of them excluded ones audited to check what they declare (Gamma); 1 not audited; "
    )
    rows = {cells[1]: (cls, cells) for cls, cells in page.rows[""]}
    assert [cls for cls, _ in page.rows[""]] == ["equivalent", "equivalent", "different", "skipped"]
    assert rows["alpha/int4"][1] == [EVIL, "alpha/int4", "int4", "0.50", "2.00", "0", "", "yes", "candidate",
                                     "audited: equivalent", "3"]  # fmt: skip
    assert rows["beta/fp8"][1][7] == "no" and rows["beta/fp8"][1][-1] == "2"
    assert rows["gamma/nvfp4"][1][-3:] == ["excluded: declared nvfp4", "audited: different", "0"]
    assert rows["delta/int4"][1][5:] == ["-5", "", "yes", "excluded: status -5", "not audited", "0"]


def test_the_served_section_prices_each_endpoints_output_and_flags_one_never_audited() -> None:
    rogue = DatasetView("code", [record("c9", turn("omega/int4", tokens=1000, cost=0.002))], {"cost_usd": 0.01}, None)
    html = served_section(served([CHAT, rogue]), VERDICTS, [CHAT, rogue], PROVIDERS)
    page = Page(html)
    assert page.text[""].startswith(
        "4 validated records from 3 endpoints. Paid for generation (validate cards, every attempt): $0.5100; of it the "
        "exported replies: $0.3070."
    )
    rows = {cells[1]: cells for _, cells in page.rows[""]}
    # paid per output token, prompts included, beside the list prices (in / out) it is not comparable to alone
    assert rows["alpha/int4"] == [EVIL, "alpha/int4", "int4", "equivalent", "2", "3", "50", "$0.3010", "6020.00",
                                  "0.50 / 2.00", "chat 2"]  # fmt: skip
    assert rows["omega/int4"][2:4] == ["?", "not audited"] and rows["omega/int4"][-3:] == ["2.00", "—", "code 1"]
    assert rows["beta/fp8"][-3] == "200.00"
    assert "$ per M output tokens paid (prompts included)" in html


def test_the_budget_section_sets_the_spend_against_the_plan_and_projects_it_to_the_target() -> None:
    plan = plan_budget(PROVIDERS, SHIPPED.survey.budget, SHIPPED.verify)
    target = plan["target_output_tokens"]
    page = Page(budget_section(plan, VERDICTS, DATASETS, PROVIDERS))
    rows = {cells[0]: cells[1:] for _, cells in page.rows[""]}
    assert rows["budget (survey.budget.usd)"][0] == f"${plan['budget_usd']:,.2f}"
    assert plan["verification"]["cost_usd"] < 1 and rows["audit, planned worst case"][0] == (
        f"${plan['verification']['cost_usd']:.4f}"  # under $1: four decimals
    )
    assert rows["audit, spent"] == ["$0.0024", "36 probes"]  # 3 providers × 12 probes
    assert rows["generation, spent"] == ["$0.5000", f"4,000 output tokens of the {target:,} target ({4000 / target:.4%})"]
    assert rows["generation, projected to the target"] == [f"${0.5 / 4000 * target:,.2f}", "at the $125.00/M paid so far"]
    assert rows["generation, possibly billed"][0] == "$0.0300"  # timed out or cut off: shown, not folded into "spent"
    left = plan["budget_usd"] - 0.0024 - 0.5
    assert rows["spent in all"] == [
        "$0.5024",
        f"${left:,.2f} of the budget left, ${left - 0.03:,.2f} if all that was possibly billed was",
    ]
    assert [label for label in rows if label.startswith("plan at")] == [
        *(f"plan at the {s} candidate" for s in ("cheapest", "median", "worst")),
        "plan at the cheapest eligible endpoint",
    ]
    assert rows["plan at the cheapest candidate"][1].endswith("; audited equivalent")


def test_the_budget_plan_is_priced_again_over_the_endpoints_the_audit_found_eligible() -> None:
    """The survey plans over candidates before the audit: its cheapest may be one the audit
    rejected, and the page must not leave it standing as the plan."""
    cheap = dataclasses.replace(surveyed("Cheap", "cheap/int4"), completion_usd_per_m=1.0)
    dear = dataclasses.replace(surveyed("Dear", "dear/int4"), completion_usd_per_m=3.0)
    plan = plan_budget([cheap, dear], SHIPPED.survey.budget, SHIPPED.verify)
    audit = verdicts_of(provider_verdict("cheap/int4", "different"), provider_verdict("dear/int4"))
    rows = {cells[0]: cells[1:] for _, cells in Page(budget_section(plan, audit, DATASETS, [cheap, dear])).rows[""]}
    assert rows["plan at the cheapest candidate"][1].startswith("cheap/int4 at $1.00/M out")
    assert rows["plan at the cheapest candidate"][1].endswith("; audited different: not bought from")
    repriced = price_scenario("cheapest eligible", dear, SHIPPED.survey.budget)
    assert rows["plan at the cheapest eligible endpoint"][0] == f"${repriced.total_cost_usd:,.2f}"
    assert rows["plan at the cheapest eligible endpoint"][1].startswith("dear/int4 at $3.00/M out")
    nothing = verdicts_of(provider_verdict("cheap/int4", "different"), provider_verdict("dear/int4", "inconclusive"))
    rows = {cells[0]: cells[1:] for _, cells in Page(budget_section(plan, nothing, DATASETS, [cheap, dear])).rows[""]}
    assert rows["plan at the cheapest eligible endpoint"] == ["—", "the audit found no endpoint eligible"]


def test_sections_with_nothing_to_show_say_what_is_missing() -> None:
    assert served_section([], VERDICTS, [], PROVIDERS) == "<p>No generated records yet.</p>"
    assert budget_section(None, VERDICTS, DATASETS, PROVIDERS) == "<p>No budget plan found (run the survey stage).</p>"
    assert overview_section(verdicts_of(), MARGIN) == "<p>No provider was audited.</p>"


def test_the_monitoring_section_says_what_the_audit_did_not_verify_of_each_datasets_sampling() -> None:
    note = "the audit verified each provider at temperature 1, top-p 1 (the raw distribution); <b>not</b> at 0.7"
    warm = {"verified_sampling": {"differs": ["temperature"], "note": note}}
    raw = {"verified_sampling": {"differs": [], "note": "generation samples the distribution the audit verified"}}
    datasets = [DatasetView(n, [], card, None) for n, card in (("chat", warm), ("code", warm), ("math", raw), ("x", None))]
    section = monitor_section(datasets)
    assert section.count("class='caveat'") == 1 and "<b>chat, code</b>" in section
    assert "&lt;b&gt;not&lt;/b&gt; at 0.7" in section and "generation samples the distribution" not in section
    assert "caveat" not in monitor_section(datasets[2:])


def test_the_overview_says_what_the_margins_were_measured_on() -> None:
    providers = [provider_verdict("a/int4")]
    kimi = verdicts_of(*providers, model="moonshotai/kimi-k2.5", calibration=Calibration.of("moonshotai/kimi-k2.5").model_dump())
    assert (
        "<p class='caveat'>Calibration: verify.margin and the mixture detection rates are not measured for moonshotai/kimi-k2.5"
        in (overview_section(kimi, MARGIN))
    )
    assert "Calibration: not recorded" in overview_section(verdicts_of(*providers), MARGIN)


def test_the_overview_shows_each_logprob_effect_as_tested_and_unclipped() -> None:
    """Clipped at the tail as the test bets on it, every coarse provider read 0.25; the
    unclipped mean beside it tells them apart."""
    coarse = [
        provider_verdict(tag, "different", effects={
            "mean_abs_dlogprob_clipped": Estimate(value=0.25, ci_low=0.25, ci_high=0.25),
            "mean_abs_dlogprob": Estimate(value=value, ci_low=value - 0.1, ci_high=value + 0.1),
        })
        for tag, value in (("nv/nvfp4", 0.61), ("mx/fp4", 1.37))
    ]  # fmt: skip
    coarse = [v.model_copy(update={"e_value": 1.18e34}) for v in coarse]
    html = overview_section(verdicts_of(*coarse), MARGIN)
    rows = [cells for _, cells in Page(html).rows[""]]
    assert [row[6:8] for row in rows] == [["0.25 [0.25, 0.25]", "0.61 [0.51, 0.71]"], ["0.25 [0.25, 0.25]", "1.37 [1.27, 1.47]"]]
    assert [row[8] for row in rows] == ["34.1", "34.1"]  # the e-value tells them apart no better than clipped
    assert f"clipped at {MARGIN.tail_dlogprob:g}" in html and "unclipped" in html


# -- the page ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page_html() -> str:
    return render(model="acme/<model>", providers=PROVIDERS, verdicts=VERDICTS, provider_plots={}, datasets=DATASETS,
                  margin=MARGIN, policy=POLICY, plan=None)  # fmt: skip


def test_the_page_summary_counts_the_whole_audit(page_html: str) -> None:
    page = Page(page_html)
    assert page.text["summary"] == (
        f"4 endpoints surveyed, 2 excluded; 3 audited: 1 different, 2 equivalent. 4 training records (75 output tokens) "
        f"across 2 dataset(s) from 2 endpoints for $0.5000 (and $0.0300 possibly billed); verification probes $0.0024. "
        "Reference deployment: "
        f"{SHIPPED.survey.model}. Verification MLflow run: verify-run."
    )


def test_every_audited_provider_has_a_row_classed_and_coloured_by_its_verdict(page_html: str) -> None:
    page = Page(page_html)
    for section in ("overview", "verdicts"):
        assert [(cls, cells[0], cells[1]) for cls, cells in page.rows[section]] == [
            ("equivalent", EVIL, "alpha/int4"), ("equivalent", "Beta", "beta/fp8"), ("different", "Gamma", "gamma/nvfp4"),
        ]  # fmt: skip
    for verdict, color in figures.VERDICT_COLORS.items():
        assert f".{verdict}{{background:{color}22}}" in page_html
    surveyed_tags = [cells[1] for _, cells in page.rows["providers"]]
    assert surveyed_tags == ["alpha/int4", "beta/fp8", "gamma/nvfp4", "delta/int4"]


def test_the_verdict_detail_shows_each_tests_p_values_and_the_runs_it_came_from(page_html: str) -> None:
    alpha = Page(page_html).rows["verdicts"][0][1]
    assert alpha[7] == "tail: p=0.2 (adj 0.4)\nmean: p=0.03"  # adjusted only where a correction applied
    assert alpha[9:] == ["12", "$0.0010", "run-alpha"]
    gamma = Page(page_html).rows["verdicts"][2][1]
    assert gamma[-1] == "" and gamma[6] == ""  # no MLflow run, no effects: empty, not "None"


def test_names_from_the_gateway_are_shown_escaped_never_parsed(page_html: str) -> None:
    page = Page(page_html)
    assert "labs" not in page.tags and "model" not in page.tags  # no element was injected (the parser lower-cases tags)
    assert "<Labs>" not in page_html and "O&#x27;Brien &lt;Labs&gt; &amp; Co" in page_html
    assert "<title>quanthunt report: acme/&lt;model&gt;</title>" in page_html


def test_the_datasets_table_shows_validated_and_unvalidated_datasets(page_html: str) -> None:
    chat, code = (cells for _, cells in Page(page_html).rows["datasets"])
    assert chat[:6] == ["chat", "3", "70", "$0.5000", "$0.0300", "passed"] and chat[7] == "none"
    assert code[:6] == ["code", "1", "5", "$0.0000", "$0.0000", "not validated"]
