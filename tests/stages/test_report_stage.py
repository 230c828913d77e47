"""The report page: built from a validated dataset and verdicts, self-contained, telling
the whole audit on one page (who was surveyed, excluded and why, audited with what result,
who served what at what cost, the budget plan against the spend), every plot labelled, and
rendered by headless Chromium with every plot loaded and inside the page."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from fixtures.generation import GenerationBed
from fixtures.params import SHIPPED
from fixtures.sandbox import provider
from PIL import Image

from quanthunt.verdicts import Estimate, Observed, Verdicts, load_verdicts

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]  # fmt: skip
SECTIONS = ("summary", "overview", "providers", "verdicts", "served", "budget", "shift", "power", "datasets",
            "monitoring", "tokens")  # fmt: skip
MIN_POWER = 0.9  # not the default (0.95): the power plot's line must come from the params
BUDGET_USD = 37.5


class Page(HTMLParser):
    """The page's ids, images and links, and the text and images of each ``<section id>``."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.images: list[str] = []
        self.alts: list[str] = []
        self.external: list[str] = []
        self.text: dict[str, str] = {}
        self.section_images: dict[str, list[bytes]] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(str(values["id"]))
        if tag == "section":
            self._open.append(values.get("id"))
            self.text.setdefault(str(values.get("id")), "")
        if tag == "img":
            src = str(values.get("src", ""))
            self.images.append(src)
            self.alts.append(str(values.get("alt", "")))
            if self._section and src.startswith("data:image/png;base64,"):
                import base64

                self.section_images.setdefault(self._section, []).append(base64.b64decode(src.split(",", 1)[1]))
        for name in ("src", "href"):
            if values.get(name, "") and str(values[name]).startswith(("http:", "https:", "//")):
                self.external.append(str(values[name]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "section" and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._section:
            self.text[self._section] += data + " "

    @property
    def _section(self) -> str | None:
        return self._open[-1] if self._open else None


def description(png: bytes) -> str:
    """What a plot says it draws (its axes, labels and legend), from the PNG's Description."""
    text: dict[str, str] = Image.open(io.BytesIO(png)).text  # type: ignore[attr-defined]
    return text.get("Description", "")


def audited(verdicts: Verdicts) -> Verdicts:
    """The fixture's two eligible providers as a real audit leaves them (effects with
    intervals, completions), plus Gamma, declared nvfp4: excluded by the survey, audited
    anyway and found different. Delta (status -5) stays unaudited."""

    def effects(pit: float, shift: float) -> dict[str, Estimate]:
        return {
            "mean_pit": Estimate(value=pit, ci_low=pit - 0.06, ci_high=pit + 0.06),
            "rank_z": Estimate(value=(pit - 0.5) * 4, ci_low=(pit - 0.5) * 4 - 0.2, ci_high=(pit - 0.5) * 4 + 0.2),
            "mean_abs_dlogprob_clipped": Estimate(value=shift, ci_low=shift * 0.8, ci_high=shift * 1.2),
            "mean_abs_dlogprob": Estimate(value=shift, ci_low=shift * 0.8, ci_high=shift * 1.2),
        }

    alpha, beta = (p.model_copy(update={"completions": 36, "probes": 36, "effects": effects(0.5, 1e-7),
                                        "power": {"mixture": 0.97}}) for p in verdicts.providers)  # fmt: skip
    gamma = beta.model_copy(
        update={
            "provider": "Gamma",
            "tag": "gamma/nvfp4",
            "declared_quantization": "nvfp4",
            "eligible": False,
            "survey_decision": "excluded: declared nvfp4",
            "verdict": "different",
            "completions": 12,
            "probes": 12,
            "reason": "mean |Δ logprob| beyond the margin",
            "effects": effects(0.81, 0.25),
            "cost_usd": 0.0004,
            "observed": Observed(shift=[], z=[]),
        }
    )
    return verdicts.model_copy(update={"providers": [alpha, beta, gamma], "cost_usd": 0.0011})


@pytest.fixture
def reported(generation_bed: Callable[..., GenerationBed]) -> GenerationBed:
    faults = {"retry_after_s": 0.05, "timeout_s": 5}
    roster = [
        provider("alpha", latency_ms=20, faults=faults),
        provider("beta", latency_ms=20, faults=faults, pricing={"prompt": "0.000002", "completion": "0.000004"}),
        provider("gamma", quantization="nvfp4", tag="gamma/nvfp4", precision="nvfp4", latency_ms=20),
        provider("delta", status=-5, uptime_last_30m=41.0, latency_ms=20),  # down: excluded, never audited
    ]
    bed = generation_bed(
        records=10,
        roster_extra={"providers": roster},
        params={
            "generate.monitor.share": 1.0,  # every reply monitored: a plot to draw
            "verify.decision.min_power": MIN_POWER,
            "survey.budget.usd": BUDGET_USD,
            "survey.policy.max_completion_usd_per_m": 5.0,  # Beta's $4/M: a candidate, as its verdict says
        },
    )
    assert bed.generate().returncode == 0
    assert bed.project.run("validate", "tiny", "--params", "params.yaml").returncode == 0
    path = bed.project.root / "reports/verify/verdicts.json"
    path.write_text(audited(load_verdicts(path)).model_dump_json(indent=2))
    done = bed.project.run("report", "--params", "params.yaml")
    assert done.returncode == 0, done.stderr
    return bed


def page_of(bed: GenerationBed) -> Page:
    page = Page()
    page.feed((bed.project.root / "reports/index.html").read_text())
    return page


def test_page_is_self_contained_and_labels_every_plot(reported: GenerationBed) -> None:
    page = page_of(reported)
    assert set(SECTIONS) <= page.ids
    assert len(page.images) >= 6 and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert any("monitors of tiny" in alt for alt in page.alts)
    assert page.external == []
    with (reported.project.root / "reports/plots/cost.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["provider"] for r in rows} <= {"Alpha", "Beta"} and sum(float(r["cost_usd"]) for r in rows) > 0
    plots = [png for images in page.section_images.values() for png in images]
    assert len(plots) == len(page.images)
    for png in plots:
        drawn = description(png)
        axes = [line for line in drawn.splitlines() if line.startswith("axes")]
        assert axes, "a plot with no description"
        for line in axes:
            assert not re.search(r"x:  \||y:  \||y: $", line), f"unlabelled axis: {line}"
    (power,) = page.section_images["power"]
    drawn = description(power)
    assert f"min_power {MIN_POWER:g}" in drawn and "0.95" not in drawn  # the line params.yaml asks for, labelled
    assert "audited: Alpha, Beta (36)" in drawn and "audited: Gamma (12)" in drawn  # the completions actually audited
    assert f"min_power = {MIN_POWER:g}" in page.text["power"]


def test_page_tells_who_was_surveyed_excluded_audited_and_paid(reported: GenerationBed) -> None:
    root = reported.project.root
    page = page_of(reported)
    (figure,) = page.section_images["overview"]  # the audit at a glance: one row per audited provider
    drawn = description(figure)
    assert "rows: Alpha (36); Beta (36); Gamma (12)" in drawn and "Delta" not in drawn
    margin = SHIPPED.verify.margin  # params.yaml's margins
    assert f"sampler equivalence margin ±{margin.sampler_equivalence:g}" in drawn
    assert f"logprob margin {margin.mean_abs_dlogprob:g}" in drawn
    assert "legend: equivalent; different; inconclusive" in drawn  # coloured by verdict
    overview = page.text["overview"]
    assert re.search(r"Gamma\s.*different", overview) and re.search(r"Alpha\s.*equivalent", overview)

    surveyed = page.text["providers"]  # who was surveyed, excluded and why, audited or not
    assert re.search(r"Delta\s+delta/int4\s.*excluded: status -5\s+not audited", surveyed)
    assert re.search(r"Gamma\s+gamma/nvfp4\s.*excluded: declared nvfp4\s+audited: different", surveyed)
    assert re.search(r"Alpha\s+alpha/int4\s.*candidate\s+audited: equivalent", surveyed)

    card = json.loads((root / "data/final/tiny.card.json").read_text())
    served = page.text["served"]  # who served how much, at what cost
    assert card["providers"]
    for entry in card["providers"]:
        assert re.search(rf"{entry['provider']}\s+{re.escape(entry['tag'])}\s+\S+\s+\S+\s+{entry['records_served']}\s", served)
    assert "Gamma" not in served and "Delta" not in served
    assert f"${card['cost_usd']:.4f}" in served

    plan = json.loads((root / "reports/survey/budget_plan.json").read_text())
    budget = page.text["budget"]  # the plan against the spend
    assert f"${BUDGET_USD:,.2f}" in budget and plan["scenarios"][0]["tag"] in budget
    assert f"${plan['verification']['cost_usd']:.4f}" in budget  # the audit planned, worst case ...
    assert "$0.0011" in budget  # ... against what it spent (verdicts.json)
    assert f"{card['tokens']['completion']:,} output tokens of the {plan['target_output_tokens']:,} target" in budget


@pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (CI installs Debian's chromium); the parser-level test above ran"
)
def test_chromium_renders_every_plot(reported: GenerationBed, tmp_path: Path) -> None:
    page = (reported.project.root / "reports/index.html").resolve().as_uri()
    profile = tmp_path / "profile"
    common = [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000"]
    dom = subprocess.run([*common, "--window-size=1000,2000", "--dump-dom", page], capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    state: dict[str, Any] = {k: int(v) for k, v in re.findall(r'data-images-(\w+)="(\d+)"', dom)}
    assert state["total"] >= 6
    assert state["loaded"] == state["total"]  # every embedded plot decoded and laid out
    assert state["overflowing"] == 0  # each sized to the page, even a narrow window
    tables: dict[str, Any] = {k: int(v) for k, v in re.findall(r'data-tables-(\w+)="(\d+)"', dom)}
    assert tables["total"] >= 6 and tables["overflowing"] == 0  # every table's columns fit (the detail table ran to 1,500 px)
    shot = tmp_path / "report.png"
    subprocess.run(
        [*common, f"--screenshot={shot}", "--window-size=1400,3000", page], capture_output=True, timeout=120, check=True
    )
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000
