"""``kiloserve plan --stages``: simulate each growth stage and write stages.md / .json.

The stage computation is ``kiloserve.plan.stages``; this module runs one simulated
cluster per stage (``pareto.simulate_deployment``: the stage's replicas at the load
they sustain) and renders the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kiloserve.plan.capacity import CapacityResult, PercentileSlo, slo_violations
from kiloserve.plan.pareto import simulate_deployments
from kiloserve.plan.planner import Candidate, Deployment, plan_deployment
from kiloserve.plan.stages import STAGE_CARDS, Stage, StageChoice, build_stage, choose_for_stage
from kiloserve.results.report import write_json

__all__ = ["STAGES_SCHEMA_VERSION", "run_stages", "stages_markdown", "write_stages"]

logger = logging.getLogger(__name__)
STAGES_SCHEMA_VERSION = 1


def run_stages(
    candidates: Sequence[Candidate],
    capacities: Mapping[str, CapacityResult],
    prices: Callable[[Candidate], float],
    *,
    slo: PercentileSlo,
    workload_spec: str,
    mean_output_tokens: float,
    headroom: float,
    seed: int,
    duration_s: float,
    policy: str,
    stage_cards: Sequence[int] = STAGE_CARDS,
    jobs: int | None = None,
    ray_address: str | None = None,
) -> list[Stage]:
    """One stage per card count: choice, simulated run, targets, must-dos, indicators.
    The stages' runs are independent: they run side by side (``jobs``, Ray)."""
    choices = [choose_for_stage(n, candidates, capacities, prices, headroom) for n in stage_cards]
    runs = [_run(c, mean_output_tokens, prices) for c in choices if c is not None]
    summaries = iter(simulate_deployments(
        runs, workload_spec, seed=seed, slo=slo, duration_s=duration_s, policy=policy,
        jobs=jobs, ray_address=ray_address, label="stages",
    ))  # fmt: skip
    stages: list[Stage] = []
    previous: StageChoice | None = None
    for index, (num_cards, choice) in enumerate(zip(stage_cards, choices, strict=True), 1):
        summary = next(summaries) if choice is not None else None
        stage = build_stage(
            index, num_cards, choice, summary, candidates=candidates, previous=previous,
            mean_output_tokens=mean_output_tokens, policy=policy,
        )  # fmt: skip
        if summary is not None:
            stage.is_slo_met = not slo_violations(summary, slo)
        stages.append(stage)
        previous = choice or previous
    return stages


def _run(
    choice: StageChoice, mean_output_tokens: float, prices: Callable[[Candidate], float]
) -> tuple[Deployment, int, float]:
    """The stage's cluster run for ``simulate_deployments``."""
    deployment = plan_deployment(
        choice.candidate,
        choice.capacity,
        choice.rate_rps,
        mean_output_tokens,
        price_per_gpu_hour=prices(choice.candidate),
    )
    assert deployment is not None  # a choice fits and has capacity
    logger.info(
        "stage: %d cards (%d x %s) at %.3g req/s",
        choice.num_replicas * choice.candidate.tp, choice.num_replicas, choice.candidate.name,
        choice.rate_rps,
    )  # fmt: skip
    return deployment, choice.num_replicas, choice.rate_rps


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _summary_row(stage: Stage) -> str:
    c, t = stage.choice, stage.targets_ms
    if c is None:
        cells = ["does not fit", "-", "-", "-", "-", "-", "-", "-", "-"]
    else:
        slo = "met" if stage.is_slo_met else "missed"
        cells = [
            f"{c.candidate.gpu.name} TP{c.candidate.tp} {c.candidate.quant} x {c.num_replicas}",
            f"{c.rate_rps:,.0f}" if c.rate_rps >= 100 else f"{c.rate_rps:.3g}",
            f"{c.rate_rps * 86_400 / 1e6:.2f}M",
            *(_ms(t.get(k)) for k in ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "e2e_p95")),
            slo,
        ]
    return "| " + " | ".join([str(stage.index), f"{stage.num_cards:,}", *cells,
                              stage.seed_target]) + " |"  # fmt: skip


def _target_line(stages: Sequence[Stage], target_rps: float) -> str:
    for stage in stages:
        if stage.choice is not None and stage.choice.rate_rps >= target_rps:
            return f"The target, {target_rps:g} req/s, is within stage {stage.index}."
    return f"The target, {target_rps:g} req/s, is beyond the last stage."


def stages_markdown(stages: Sequence[Stage], header: Mapping[str, Any]) -> str:
    """The stages as a markdown page: one summary table, then each stage's lists."""
    lines = [
        f"# Growth stages: {header['model']}, `{header['workload']}`, SLO `{header['slo']}`",
        "",
        "Computed by `" + " ".join(header["command"]) + "`: each stage's cards run the",
        "cheapest fitting deployment at the load they sustain (replicas x per-replica",
        f"capacity / headroom {header['headroom']:g}), simulated for {header['duration_s']:g} s",
        f"of arrivals with the `{header['policy']}` policy; the targets are that run's",
        "P50/P95 (ms). Seed 000's targets are shown for comparison, not used.",
        "",
        _target_line(stages, float(header["target_rps"])),
        "",
        "| stage | cards | deployment | req/s | req/day | P50 TTFT | P95 TTFT | P50 TPOT "
        "| P95 TPOT | P95 E2E | SLO | seed 000's target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_summary_row(s) for s in stages),
    ]
    for stage in stages:
        lines += ["", f"## Stage {stage.index}: {stage.num_cards:,} card(s)", "", "Must-dos:"]
        lines += [f"- **{m.text}**: {m.reason}" for m in stage.must_dos]
        if stage.indicators:
            lines += ["", "Key indicators (value in the run):"]
            lines += [f"- **{i.text}**: {i.reason}" for i in stage.indicators]
        if stage.not_needed:
            lines += ["", "Not needed yet:"]
            lines += [f"- {n.text}: {n.reason}" for n in stage.not_needed]
    return "\n".join(lines) + "\n"


def write_stages(out_dir: Path, stages: Sequence[Stage], header: Mapping[str, Any]) -> str:
    """Write ``stages.json`` and ``stages.md`` under ``out_dir``; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"schema_version": STAGES_SCHEMA_VERSION, **header}
    data["stages"] = [s.to_dict() for s in stages]
    write_json(out_dir / "stages.json", data)
    text = stages_markdown(stages, header)
    (out_dir / "stages.md").write_text(text)
    return text
