"""--chaos preempt=N[@TEMPLATE],kill=M[@TEMPLATE],seed=S: which pods are Spot-placed, what is injected
(deterministically for a seed), where in a pod's work it lands (at a progress report, however fast the pod),
how Argo would have recorded it, that the workflow's own retryStrategy decides the rest, and that a run
that ends before every fault landed is an error, not a clean run passed off as a chaos run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.local import run_workflow
from pipelines.local.api.status import pod_name
from pipelines.local.pods.chaos import (
    NODE_SHUTDOWN,
    POD_DELETED,
    ChaosMonkey,
    ChaosSpec,
    is_spot_placed,
    parse_chaos,
    placement,
)
from steps.errors import MoerlError
from steps.progress import PROGRESS_ANNOTATION, strike_due, strike_point

SPOT_NODE_SELECTOR = {"karpenter.sh/capacity-type": "spot"}


def test_chaos_spec_parsing():
    assert parse_chaos("preempt=3,kill=1,seed=7") == ChaosSpec(3, 1, 7)
    assert parse_chaos("kill=2") == ChaosSpec(0, 2, 0)
    assert parse_chaos(None) == ChaosSpec() and not ChaosSpec().enabled
    aimed = parse_chaos("preempt=3@rollout,kill=1@update,seed=7")
    assert aimed == ChaosSpec(3, 1, 7, preempt_at="rollout", kill_at="update")
    assert str(aimed) == "preempt=3@rollout,kill=1@update,seed=7"
    for bad in ("preempt=x", "preempt=1,boom=2", "preempt", "kill=-1", "kill=1@", "seed=1@rollout", "kill=@x"):
        with pytest.raises(MoerlError, match="--chaos"):
            parse_chaos(bad)


def required(*terms: list[dict]) -> dict:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": list(term)} for term in terms]
            }
        }
    }


def expression(key: str, *values: str, operator: str = "In") -> dict:
    return {"key": key, "operator": operator, "values": list(values)}


@pytest.mark.parametrize(
    ("node_selector", "affinity", "spot"),
    [
        ({"karpenter.sh/capacity-type": "spot"}, None, True),
        ({"eks.amazonaws.com/capacityType": "SPOT"}, None, True),
        ({"karpenter.sh/capacity-type": "on-demand"}, None, False),
        ({"node.kubernetes.io/instance-type": "p5en.48xlarge"}, None, False),
        (None, required([expression("karpenter.sh/capacity-type", "spot")]), True),
        (None, required([expression("eks.amazonaws.com/capacityType", "SPOT", "ON_DEMAND")]), True),
        # another term admits on-demand nodes: the pod may land on either
        (
            None,
            required(
                [expression("karpenter.sh/capacity-type", "spot")],
                [expression("karpenter.sh/capacity-type", "on-demand")],
            ),
            False,
        ),
        (None, required([expression("karpenter.sh/capacity-type", "spot", operator="NotIn")]), False),
        (
            None,
            {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 50,
                            "preference": {"matchExpressions": [expression("karpenter.sh/capacity-type", "spot")]},
                        }
                    ]
                }
            },
            True,
        ),
        (None, None, False),
    ],
)
def test_spot_placement_rule(node_selector, affinity, spot):
    assert is_spot_placed(node_selector, affinity) is spot


def test_placement_merges_workflow_template_and_pod_spec_patch():
    spec = {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "spot", "operator": "Exists"}]}
    template = {"podSpecPatch": "nodeSelector:\n  karpenter.sh/capacity-type: spot\nterminationGracePeriodSeconds: 5\n"}
    where = placement(template, spec)
    assert where["nodeSelector"] == {"pool": "gpu", "karpenter.sh/capacity-type": "spot"}
    assert where["terminationGracePeriodSeconds"] == 5
    assert is_spot_placed(where["nodeSelector"], where["affinity"])
    # a toleration allows Spot nodes; it does not choose them
    assert not is_spot_placed(placement({}, spec)["nodeSelector"], None)


def injections(monkey: ChaosMonkey, starts: list[tuple[str, bool]]) -> list[tuple]:
    out = []
    for name, spot in starts:
        injection = monkey.target(name, name, spot, eligible=True)
        if injection is not None:
            out.append((name, injection.kind, injection.phase, injection.message, round(injection.delay, 6)))
    return out


def test_injections_are_decided_by_the_seed():
    starts = [(f"pod-{i}", i % 2 == 0) for i in range(20)]
    first = injections(ChaosMonkey(ChaosSpec(preempt=3, kill=2, seed=11)), starts)
    assert first == injections(ChaosMonkey(ChaosSpec(preempt=3, kill=2, seed=11)), starts)
    assert first != injections(ChaosMonkey(ChaosSpec(preempt=3, kill=2, seed=12)), starts)
    preempts = [i for i in first if i[1] == "preempt"]
    kills = [i for i in first if i[1] == "kill"]
    assert len(preempts) == 3 and len(kills) == 2
    assert all(dict(starts)[name] for name, *_ in preempts)  # preemptions hit Spot-placed pods only
    # reclaims are recorded alternately as Argo sees a vanished node and a graceful node shutdown
    reclaims = [("Error", POD_DELETED), ("Failed", NODE_SHUTDOWN), ("Error", POD_DELETED)]
    assert [(p[2], p[3]) for p in preempts] == reclaims
    assert all((k[2], k[3]) == ("Error", POD_DELETED) for k in kills)


def test_an_injection_whose_target_finished_first_moves_on():
    monkey = ChaosMonkey(ChaosSpec(preempt=0, kill=1, seed=0))
    injection = None
    name = 0
    while injection is None:
        injection = monkey.target(f"p{name}", f"p{name}", False, eligible=True)
        name += 1
    monkey.missed(injection)
    assert monkey.remaining["kill"] == 1
    assert monkey.target("next", "next", False, eligible=True) is not None  # the very next start is hit


def rollouts(policy: str, spot: bool, script: str, after: list | None = None) -> dict:
    work = {
        "name": "work",
        "retryStrategy": {"limit": 2, "retryPolicy": policy},
        "container": {"image": "rollout", "command": ["sh", "-c", script]},
    }
    if spot:
        work["nodeSelector"] = SPOT_NODE_SELECTOR
    steps = [[{"name": "rollout", "template": "work", "withSequence": {"count": "4"}}]] + (after or [])
    templates = [
        {"name": "main", "steps": steps},
        work,
        {"name": "train", "container": {"image": "trainer", "command": ["true"]}},
    ]
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "chaos-"},
        "spec": {"entrypoint": "main", "templates": templates},
    }


def attempts(result) -> dict[str, dict]:
    return {n["displayName"]: n for n in result.status["nodes"].values() if n["type"] == "Pod"}


def test_spot_preemptions_are_recorded_as_argo_records_reclaims_and_retried(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")  # the 30 s grace period becomes 0.3 s
    manifest = rollouts(
        "Always",
        spot=True,
        script="trap 'echo TERM; exit 143' TERM; sleep 4 & wait",
        after=[[{"name": "train", "template": "train"}]],
    )
    result = run_workflow(manifest, chaos="preempt=2,kill=0,seed=1", workdir=tmp_path, view=None)
    assert result.succeeded  # limit 2 absorbs one reclaim per rollout
    pods = attempts(result)
    hit = {name: pod for name, pod in pods.items() if pod["phase"] != "Succeeded"}
    recorded = sorted((p["phase"], p["message"]) for p in hit.values())
    assert recorded == [("Error", POD_DELETED), ("Failed", NODE_SHUTDOWN)]
    for name, pod in hit.items():
        retry_of = name[: -len("(0)")]
        assert pods[f"{retry_of}(1)"]["phase"] == "Succeeded"  # the workflow's retryStrategy retried it
        if pod["phase"] == "Failed":  # the kubelet's graceful shutdown: SIGTERM, which the step handled
            assert pod["outputs"]["exitCode"] == "143"
            stdout = result.run_dir / "pods" / pod_name(result.name, pod["name"], "work") / "stdout.log"
            assert stdout.read_text() == "TERM\n"
        else:  # the pod vanished with its node: no exit code
            assert "exitCode" not in (pod.get("outputs") or {})
    assert pods["train"]["phase"] == "Succeeded"


def test_a_hard_kill_is_an_error_that_only_error_retrying_policies_retry(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")
    manifest = rollouts("OnFailure", spot=False, script="sleep 4")
    result = run_workflow(manifest, chaos="kill=1,seed=2", workdir=tmp_path, view=None)
    pods = attempts(result)
    killed = [p for p in pods.values() if p["phase"] == "Error"]
    assert [(p["message"], p.get("outputs")) for p in killed] == [(POD_DELETED, None)]
    assert sum(1 for p in pods.values() if p["phase"] == "Succeeded") == 3  # not Spot-placed: no preemption
    assert result.phase == "Failed"  # OnFailure does not retry an Error
    retry = next(n for n in result.status["nodes"].values() if killed[0]["id"] in n.get("children", []))
    assert (retry["type"], retry["phase"], retry["message"]) == ("Retry", "Error", POD_DELETED)


def test_preemptions_of_a_workflow_without_spot_pods_or_aimed_at_a_missing_template_are_refused(tmp_path: Path):
    on_demand = rollouts("Always", spot=False, script="true")
    with pytest.raises(MoerlError, match="no template of this workflow is Spot-placed"):
        run_workflow(on_demand, chaos="preempt=1", workdir=tmp_path, view=None)
    spot = rollouts("Always", spot=True, script="true", after=[[{"name": "train", "template": "train"}]])
    with pytest.raises(MoerlError, match="template 'train' is not Spot-placed"):
        run_workflow(spot, chaos="preempt=1@train", workdir=tmp_path, view=None)
    with pytest.raises(MoerlError, match="has no template 'update'; aim at one of main, train, work"):
        run_workflow(spot, chaos="kill=1@update", workdir=tmp_path, view=None)
    assert not list(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.parametrize(
    ("total", "fraction", "point"),
    [(1, 0.0, 0), (1, 0.99, 0), (2, 0.01, 1), (2, 0.99, 1), (5, 0.0, 1), (5, 0.5, 3), (5, 0.999, 4), (0, 0.5, 0)],
)
def test_the_strike_point_lies_inside_the_work(total, fraction, point):
    assert strike_point(total, fraction) == point
    if total >= 2:
        assert 0 < point < total  # some units done, some left
    assert strike_due(point, total, fraction) == (total > 0)
    assert not strike_due(total, total, fraction)  # a finished step is never struck


# A pod that reports progress and does its work at full speed, with no sleep anywhere: the strike must still
# land between two of its reports. UNITS is printed as each unit is done, so the log shows where it landed.
FAST_STEP = """
import sys
from steps import progress
units = 6
progress.report(0, units)
for done in range(1, units + 1):
    print(done, flush=True)
    progress.report(done, units)
"""


def progress_workflow(spot: bool, pods: int = 6) -> dict:
    """`pods` parallel pods of FAST_STEP: with 0-2 eligible starts let pass before each target, 6 take any two
    faults."""
    work = {
        "name": "work",
        "metadata": {"annotations": {PROGRESS_ANNOTATION: "0/1"}},
        "retryStrategy": {"limit": 2, "retryPolicy": "Always"},
        "container": {"image": "cpu", "command": ["python", "-c", FAST_STEP]},
    }
    if spot:
        work["nodeSelector"] = SPOT_NODE_SELECTOR
    steps = [[{"name": "step", "template": "work", "withSequence": {"count": str(pods)}}]]
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "progress-"},
        "spec": {"entrypoint": "main", "templates": [{"name": "main", "steps": steps}, work]},
    }


@pytest.mark.parametrize("chaos", ["preempt=2,seed=3", "kill=2,seed=5", "preempt=1,kill=1,seed=11"])
def test_a_pod_that_reports_progress_is_struck_inside_its_work_however_fast_it_runs(tmp_path: Path, monkeypatch, chaos):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    result = run_workflow(progress_workflow(spot=True), chaos=chaos, workdir=tmp_path, view=None)
    assert result.succeeded, result.message
    pods = attempts(result)
    hit = {name: pod for name, pod in pods.items() if pod["phase"] != "Succeeded"}
    spec = parse_chaos(chaos)
    assert len(hit) == spec.preempt + spec.kill  # every fault landed, none was passed on
    for name, pod in hit.items():
        assert pod["message"] in (POD_DELETED, NODE_SHUTDOWN)
        stdout = result.run_dir / "pods" / pod_name(result.name, pod["name"], "work") / "stdout.log"
        units_done = stdout.read_text().split()
        assert 1 <= len(units_done) <= 5, units_done  # struck after some units of its work and before the end
        assert pods[f"{name[: -len('(0)')]}(1)"]["phase"] == "Succeeded"  # and retried


def test_the_same_seed_strikes_the_same_attempts_at_the_same_units(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))

    def where_struck(workdir: Path) -> list[tuple[str, str, int]]:
        result = run_workflow(progress_workflow(spot=True), chaos="preempt=1,kill=1,seed=4", workdir=workdir,
                              view=None)  # fmt: skip
        out = []
        for name, pod in sorted(attempts(result).items()):
            if pod["phase"] != "Succeeded":
                stdout = result.run_dir / "pods" / pod_name(result.name, pod["name"], "work") / "stdout.log"
                out.append((name, pod["message"], len(stdout.read_text().split())))
        return out

    first = where_struck(tmp_path / "a")
    assert len(first) == 2 and first == where_struck(tmp_path / "b")


def test_a_run_that_succeeds_before_every_fault_landed_is_an_error(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    # three pods and their retries: a retry of a hit attempt is never hit, so four kills cannot all land
    with pytest.raises(MoerlError, match=r"--chaos kill=4,seed=0: the workflow ended with 0 of 0 preemptions and "
                                         r"[0-3] of 4 kills landed, so it is not the chaos run asked for"):  # fmt: skip
        run_workflow(progress_workflow(spot=False, pods=3), chaos="kill=4,seed=0", workdir=tmp_path, view=None)


def test_kills_aimed_at_a_template_hit_only_its_pods(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    manifest = progress_workflow(spot=False)
    other = {**manifest["spec"]["templates"][1], "name": "other"}
    manifest["spec"]["templates"].append(other)
    manifest["spec"]["templates"][0]["steps"].insert(0, [{"name": "first", "template": "other"}])
    result = run_workflow(manifest, chaos="kill=2@work,seed=0", workdir=tmp_path, view=None)
    assert result.succeeded, result.message
    hit = [pod for pod in attempts(result).values() if pod["phase"] != "Succeeded"]
    assert len(hit) == 2 and all(pod["templateName"] == "work" for pod in hit)
