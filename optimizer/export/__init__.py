"""Export a validated winner: choose from the Pareto front, re-measure, write deployment files.

A "best" configuration measured once is often not the best once deployed (noise, arrival
order), so export is three steps, one module each:

1. :mod:`.choose`: a trial from the feasible Pareto front by an explicit policy;
2. :mod:`.revalidate`: the chosen configuration and the baseline run again N times,
   alternating, and the gain is judged against the noise of the re-runs;
3. :mod:`.render`: the configuration written for a target (vLLM config or command line,
   Kubernetes, Helm values, Ray Serve) with a header saying where its numbers come from.

:mod:`.workflow` is the use case that strings them together; the CLI, the service and the
study benchmark all call it.
"""

from optimizer.export.choose import POLICIES, default_policy, parse_weights, select_trial
from optimizer.export.render import (
    DEPLOY_FORMATS,
    FORMATS,
    Deployment,
    ExportContext,
    check_deployment,
    default_filename,
    helm_schema_problems,
    render,
    trace_label,
    write_export,
)
from optimizer.export.revalidate import Validation, primary_metrics, validate_choice
from optimizer.export.verdict import stored_gain, verdict_lines
from optimizer.export.workflow import (
    Choice,
    Submit,
    choose,
    context,
    revalidate,
    revalidate_job,
    unvalidated_gain,
    verdict,
)
from optimizer.report import changed_args

__all__ = [
    "DEPLOY_FORMATS",
    "FORMATS",
    "POLICIES",
    "Choice",
    "Deployment",
    "ExportContext",
    "Submit",
    "Validation",
    "changed_args",
    "check_deployment",
    "choose",
    "context",
    "default_filename",
    "default_policy",
    "helm_schema_problems",
    "parse_weights",
    "primary_metrics",
    "render",
    "revalidate",
    "revalidate_job",
    "select_trial",
    "stored_gain",
    "trace_label",
    "unvalidated_gain",
    "validate_choice",
    "verdict",
    "verdict_lines",
    "write_export",
]
