"""The quality gate on a prepared study: its prompts, its servers' environments, its folder.

Above the study (it takes a :class:`~optimizer.study.StudyPlan`): the study driver runs
:func:`gate_plan` before it ends (``quality.enabled``), and ``vllm-autotune quality`` runs it on
a study folder, for the front or for named trials. The servers run where this process runs,
one at a time, beside no trial (on a GPU host: the GPUs this process sees).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.engine.models import model_info
from optimizer.quality.check import Verdict
from optimizer.quality.run import prompts_for
from optimizer.quality.stage import gate_front, settings_of

if TYPE_CHECKING:
    import optuna

    from optimizer.study import StudyPlan

__all__ = ["gate_plan"]


def gate_plan(
    plan: StudyPlan,
    study: optuna.Study,
    *,
    only: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[tuple[int, Verdict]]:
    """The gate over ``study``'s front (or the trials ``only`` names), in ``plan.out/quality``.

    Each server gets the environment its trial ran with; the prompts are the trace's first
    requests, built as the replay builds them.
    """
    settings = settings_of(plan.job.quality)
    workdir = Path(plan.out) / "quality"
    prompts = prompts_for(plan.trace, plan.token_range, settings)

    def env_for(args: Mapping[str, Any]) -> Mapping[str, str]:
        spec = plan.trial_spec(0, dict(args), workdir=workdir / "spec", seed=0)
        return dict(spec.engine.env)

    model = plan.engine.model
    vocab = model_info(model).vocab_size if Path(model).is_dir() else None
    return gate_front(
        study,
        model=model,
        baseline_args=plan.baseline_args,
        env_for=env_for,
        prompts=prompts,
        workdir=workdir,
        settings=settings,
        python=plan.job.engine.python,
        startup_timeout_s=plan.job.engine.startup_timeout_s,
        vocab_size=vocab,
        only=only,
        progress=progress,
    )
