"""deploy/kubernetes/*.yaml against the Kubernetes schema and against rtrain.

Schema: every object is checked field by field against the official Python client's models
(`kubernetes.client`, generated from the API's OpenAPI spec): an unknown field name or a value
of the wrong type is an error (the client's own deserializer would drop or keep them silently),
then the object is built into its model, which refuses missing required fields. rtrain: the
container's `rtrain launch` arguments parse with rtrain's own command line, the grace period
covers rtrain's, the failure policy maps rtrain's exit codes, and a multi-node Job's pods meet at
the rendezvous its Service names.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml
from kubernetes import client as k8s  # the dev extras pin it

from rtrain.supervisor.config import Config
from rtrain.supervisor.core.errors import ExitCode

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
MODELS = {("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
          ("v1", "Service"): "V1Service", ("batch/v1", "Job"): "V1Job"}
FAIL_JOB = {ExitCode.GAVE_UP, ExitCode.USAGE, ExitCode.STARTUP, ExitCode.GAVE_UP_EARLIER}
SWEEP_S = 10  # after the grace: rtrain's sweep of the process tree and its records


def schema_errors(value: Any, type_name: str, where: str) -> list[str]:
    """Where `value` does not fit the client's type `type_name` (a model or a primitive)."""
    m = re.fullmatch(r"list\[(.+)\]", type_name)
    if m:
        if not isinstance(value, list):
            return [f"{where}: want a list, got {type(value).__name__}"]
        return [e for i, v in enumerate(value)
                for e in schema_errors(v, m.group(1), f"{where}[{i}]")]
    m = re.fullmatch(r"dict[\[(](\w+), (.+)[\])]", type_name)
    if m:
        if not isinstance(value, dict):
            return [f"{where}: want a mapping, got {type(value).__name__}"]
        return [e for k, v in value.items() for e in schema_errors(v, m.group(2), f"{where}.{k}")]
    primitive = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float),
                 "object": (object,), "datetime": (str,), "date": (str,)}
    if type_name in primitive:
        ok = isinstance(value, primitive[type_name])
        if type_name in ("int", "float") and isinstance(value, bool):
            ok = False
        return [] if ok else [f"{where}: want {type_name}, got {type(value).__name__} {value!r}"]
    model = getattr(k8s, type_name)
    if not isinstance(value, dict):
        return [f"{where}: want a {type_name} mapping, got {type(value).__name__}"]
    fields = {json: attr for attr, json in model.attribute_map.items()}
    errors = []
    for key, v in value.items():
        if key not in fields:
            errors.append(f"{where}: unknown field {key!r} in {type_name}")
        else:
            errors += schema_errors(v, model.openapi_types[fields[key]], f"{where}.{key}")
    return errors


def validate(doc: dict[str, Any]) -> list[str]:
    """Schema errors of one manifest object; building its model raises on a missing field."""
    name = MODELS.get((doc.get("apiVersion"), doc.get("kind")))
    if name is None:
        return [f"{doc.get('apiVersion')}/{doc.get('kind')}: not a kind these manifests use"]
    errors = schema_errors(doc, name, doc["kind"])
    if not errors:
        try:
            k8s.ApiClient()._ApiClient__deserialize(doc, name)
        except ValueError as e:
            errors.append(f"{doc['kind']}: {e}")
    return errors


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def launch_options(args: list[str]) -> dict[str, Any]:
    """`rtrain launch ARGS` parsed by rtrain's own command line (unknown options and bad
    values fail here, as they would in the pod)."""
    from rtrain.supervisor.cli import app

    launch = typer.main.get_command(app).commands["launch"]  # type: ignore[attr-defined]
    try:
        ctx = launch.make_context("launch", list(args))
    except click.UsageError as e:
        pytest.fail(f"rtrain launch {' '.join(args)}: {e.format_message()}")
    return ctx.params


def jobs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in MANIFESTS for d in documents(p) if d["kind"] == "Job"]


def test_there_are_a_job_a_mirror_job_and_an_indexed_job():
    names = {p.name for p in MANIFESTS}
    assert {"job.yaml", "job-mirror.yaml", "indexed-job.yaml"} <= names
    assert any(d["spec"].get("completionMode") == "Indexed" for _, d in jobs())


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_object_fits_the_kubernetes_schema(path):
    for doc in documents(path):
        assert validate(doc) == [], path.name


def _job_yaml() -> dict[str, Any]:
    return next(d for d in documents(DEPLOY / "job.yaml") if d["kind"] == "Job")


def _rename(doc, path, new):
    *parents, last = path
    for p in parents:
        doc = doc[p]
    doc[new] = doc.pop(last)


def _set(doc, path, value):
    *parents, last = path
    for p in parents:
        doc = doc[p]
    doc[last] = value


POD = ["spec", "template", "spec"]
RULE0 = ["spec", "podFailurePolicy", "rules", 0]


@pytest.mark.parametrize("mutate, want", [
    (lambda d: _rename(d, [*POD, "terminationGracePeriodSeconds"], "terminationGracePeriod"),
     "unknown field 'terminationGracePeriod'"),
    (lambda d: _rename(d, [*POD, "containers", 0, "args"], "arguments"),
     "unknown field 'arguments'"),
    (lambda d: _rename(d, [*RULE0, "onExitCodes"], "onExitCode"), "unknown field 'onExitCode'"),
    (lambda d: _set(d, [*POD, "terminationGracePeriodSeconds"], "75"), "want int, got str"),
    (lambda d: _set(d, [*RULE0, "onExitCodes", "values"], ["1", "2"]), "want int, got str"),
    (lambda d: _set(d, [*POD, "containers", 0, "command"], "rtrain launch"), "want a list"),
    (lambda d: _set(d, ["spec", "backoffLimit"], True), "want int, got bool"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"), "`name`, must not be"),
], ids=["field-name", "args-name", "rule-field", "grace-type", "codes-type", "command-type",
        "bool-for-int", "missing-name"])
def test_a_wrong_field_name_or_type_fails_the_check(mutate, want):
    doc = copy.deepcopy(_job_yaml())
    assert validate(doc) == []
    mutate(doc)
    errors = validate(doc)
    assert any(want in e for e in errors), errors


@pytest.mark.parametrize("path, job", jobs(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_the_job_runs_rtrain_as_pid_1_with_enough_grace_and_maps_its_exit_codes(path, job):
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    (container,) = pod["containers"]
    assert container["command"] == ["rtrain", "launch"], "rtrain must be the entrypoint (PID 1)"
    assert "lifecycle" not in container, "no preStop hook: rtrain handles SIGTERM itself"
    assert "initContainers" not in pod, "no init container: rtrain resumes by itself"
    opts = launch_options(container["args"])
    assert opts["resume"] in (None, "auto")
    grace = opts["grace"] if opts["grace"] is not None else Config().grace_s
    needed = grace + SWEEP_S + (Config().mirror_final_wait_s if opts["mirror"] else 0)
    assert pod["terminationGracePeriodSeconds"] >= needed, (
        f"{path.name}: the kubelet's grace must cover rtrain's ({needed:g} s)")

    rules = job["spec"]["podFailurePolicy"]["rules"]

    def action_for(code: int) -> str | None:
        for rule in rules:  # the first matching rule decides, as in the Job controller
            on = rule.get("onExitCodes")
            if on and on["containerName"] == container["name"]:
                hit = code in on["values"]
                if hit == (on["operator"] == "In"):
                    return rule["action"]
        return None

    assert action_for(ExitCode.PREEMPTED) == "Ignore"
    for code in FAIL_JOB:
        assert action_for(code) == "FailJob", code
    assert action_for(ExitCode.ALREADY_SUPERVISED) is None  # counted: the old pod may linger
    assert action_for(137) is None  # SIGKILLed before saving: a counted failure
    assert any(c.get("type") == "DisruptionTarget"
               for r in rules if r["action"] == "Ignore" for c in r.get("onPodConditions", []))


def test_the_indexed_job_meets_at_pod_0_through_its_headless_service():
    docs = documents(DEPLOY / "indexed-job.yaml")
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    opts = launch_options(container["args"])
    name = job["metadata"]["name"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(opts["nnodes"])
    assert svc["spec"]["clusterIP"] == "None" and pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"job-name": name}  # the label the Job puts on its pods
    host, port = opts["rdzv_endpoint"].rsplit(":", 1)
    assert host == f"{name}-0.{svc['metadata']['name']}", "the rendezvous is not on pod 0"
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    # One checkpoint dir every node writes into; one run dir per node (rtrain locks it).
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert "$(NODE_INDEX)" in str(opts["run_dir"]) and "$(" not in str(opts["ckpt_dir"])
    (env,) = [e for e in container["env"] if e["name"] == "NODE_INDEX"]
    assert "job-completion-index" in env["valueFrom"]["fieldRef"]["fieldPath"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]]
    assert claims == [pvc["metadata"]["name"]]
