"""Where stages print: stderr, through rich; 140 columns when it is not a terminal; and
the tables they print."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from quanthunt.survey import ProviderRow


def stage_console() -> Console:
    return Console(stderr=True, width=None if sys.stderr.isatty() else 140)


def show_survey(rows: list[ProviderRow], plan: dict[str, object], console: Console) -> None:
    """The survey's providers and budget plan, as tables."""
    table = Table(title="Providers", title_justify="left")
    for column in ("provider", "tag", "declared", "$/M in", "$/M out", "status", "uptime", "logprobs", "decision"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r.provider, r.tag, r.declared_quantization, f"{r.prompt_usd_per_m:.2f}", f"{r.completion_usd_per_m:.2f}",
            str(r.status), f"{r.uptime_last_30m}", "yes" if r.supports_logprobs else "no", r.reason,
        )  # fmt: skip
    console.print(table)
    scenarios = plan["scenarios"]
    assert isinstance(scenarios, list)
    budget = Table(
        title=f"Budget plan: ${plan['budget_usd']:,} for {plan['target_output_tokens']:,} output tokens", title_justify="left"
    )
    for column in ("at", "endpoint", "$/M out", "cost", "within budget", "affordable tokens", "per dataset"):
        budget.add_column(column)
    for s in scenarios:
        budget.add_row(
            s["scenario"], s["tag"], f"{s['completion_usd_per_m']:.2f}", f"${s['total_cost_usd']:,.2f}",
            "yes" if s["within_budget"] else "no",
            f"{s['affordable_output_tokens']:,}", f"{s['affordable_output_tokens_per_dataset']:,}",
        )  # fmt: skip
    console.print(budget)
    verification = plan["verification"]
    assert isinstance(verification, dict)
    console.print(f"Verification probes: {verification['requests']} requests, about ${verification['cost_usd']:.4f}")
    if not plan["candidates"]:
        console.print("[bold red]No provider passes the policy: nothing can be verified or generated.[/]")
