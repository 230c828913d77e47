"""Survey stage: list the model's providers, apply the policy, plan the budget.

Writes ``providers.csv`` and ``budget_plan.json`` (all-or-nothing) and ``metrics.json``,
and records the run in MLflow.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console

from quanthunt.connection import open_targets
from quanthunt.gateway import Gateway, resolve_api_key
from quanthunt.outputs import Outputs
from quanthunt.replies import Endpoint, ModelReasoning
from quanthunt.stage import Stage
from quanthunt.survey import apply_policy, check_reasoning, plan_budget, providers_csv
from quanthunt.terminal import show_survey


async def fetch_endpoints(api_url: str, model: str) -> tuple[list[Endpoint], ModelReasoning | None]:
    async with Gateway(api_url, api_key=resolve_api_key(api_url)) as gateway:
        return await gateway.endpoints(model), await gateway.model_reasoning(model)


def main(params_path: Path, *, console: Console | None = None) -> None:
    """Run the survey stage with the params file at ``params_path``."""
    stage = Stage.open("survey", params_path, console)
    params, root, paths, console = stage.params, stage.root, stage.paths, stage.console
    with stage.tracked(params.survey) as run:
        with open_targets(params, root=root, stage="survey", needs_model=False) as targets:
            endpoints, reasoning = asyncio.run(fetch_endpoints(targets.api_url, params.survey.model))
        check_reasoning(params.reasoning.mode, reasoning, params.survey.model)
        rows = apply_policy(endpoints, params.survey.policy)
        plan = plan_budget(rows, params.survey.budget, params.verify)
        candidates = [r for r in rows if r.is_candidate]
        metrics = {  # the metrics file: headline scalars; each scenario's numbers are in the plan
            "providers": len(rows),
            "candidates": len(candidates),
            "excluded": len(rows) - len(candidates),
            "verification_cost_usd": plan["verification"]["cost_usd"],
        }
        scenarios = {
            f"{s['scenario']}_{key}": s[key] for s in plan["scenarios"] for key in ("completion_usd_per_m", "total_cost_usd")
        }
        with Outputs() as out:
            out.write_text(root / paths.survey_providers, providers_csv(rows))
            out.write_json(root / paths.survey_plan, plan)
            out.write_json(root / paths.survey_metrics, metrics)
        show_survey(rows, plan, console)
        run.log_metrics({**metrics, **scenarios})
        run.set_tags(
            {
                "providers": ",".join(r.tag for r in rows),
                "candidates": ",".join(r.tag for r in candidates),
                "declared_precision": ",".join(sorted({f"{r.tag}={r.declared_quantization}" for r in rows})),
                "model": params.survey.model,
                "gateway": "sandbox" if targets.sandbox_url else targets.api_url,
            }
        )
        for path in (paths.survey_providers, paths.survey_plan, paths.survey_metrics):
            run.log_artifact(root / path)
        run.log_input(params_path, context="params")
        if targets.roster is not None:
            run.log_input(targets.roster, context="roster")
