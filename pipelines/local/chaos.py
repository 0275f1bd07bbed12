"""--chaos preempt=N,kill=M,seed=S: Spot reclaims and hard kills, recorded the way Argo records them.

Which pods are Spot-placed: a pod whose nodeSelector pins a Spot capacity label, or whose node
affinity asks for one (a required term, or a preferred term), where the labels are Karpenter's
`karpenter.sh/capacity-type: spot` and EKS managed node groups' `eks.amazonaws.com/capacityType: SPOT`
(values compared without case). The workflow-level nodeSelector/affinity apply unless the template
sets its own, and a podSpecPatch's are read too. A toleration alone does not make a pod Spot-placed:
it allows Spot nodes, it does not choose them.

What is injected, deterministically for a seed:
- N preemptions, into attempts of Spot-placed pods: SIGTERM to the process group, SIGKILL after the
  grace period (terminationGracePeriodSeconds, default 30, times MOERL_LOCAL_TIME_SCALE). They are
  recorded alternately as phase Error "pod deleted" (the node vanished with the pod on it) and as
  phase Failed "Pod was terminated in response to imminent node shutdown." (the kubelet's graceful
  node shutdown), starting with Error.
- M hard kills into any pod (exit handlers excepted): SIGKILL, recorded as Error "pod deleted".

A seeded RNG picks, for each kind, how many eligible pod starts to let pass before the next target
(0-2) and how long after its start the target is hit (0.2-3 s). A target that finishes before its
moment passes the injection on to the next eligible pod start. A pod whose previous attempt was
itself hit is never a target, so one retry always meets a clean attempt. Exit handlers are never hit.
Then the workflow's own retryStrategy decides what is retried.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import yaml

from pipelines.local.status import ERROR, FAILED
from steps.errors import MoerlError

SPOT_LABELS = {"karpenter.sh/capacity-type": "spot", "eks.amazonaws.com/capacitytype": "spot"}
POD_DELETED = "pod deleted"
NODE_SHUTDOWN = "Pod was terminated in response to imminent node shutdown."


@dataclass(frozen=True)
class ChaosSpec:
    preempt: int = 0
    kill: int = 0
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.preempt > 0 or self.kill > 0


def parse_chaos(text: str | None) -> ChaosSpec:
    """ "preempt=3,kill=1,seed=7" -> ChaosSpec(3, 1, 7)."""
    if not text:
        return ChaosSpec()
    values = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("preempt", "kill", "seed") or not value.strip().lstrip("-").isdigit():
            raise MoerlError(
                f"--chaos {text!r}: expected preempt=N,kill=M,seed=S with integers, e.g. "
                f"preempt=3,kill=1,seed=7; {part.strip()!r} is not understood"
            )
        values[key] = int(value)
    if values.get("preempt", 0) < 0 or values.get("kill", 0) < 0:
        raise MoerlError(f"--chaos {text!r}: preempt and kill must be 0 or more")
    return ChaosSpec(**values)


def _label_is_spot(key: str, value: object) -> bool:
    return SPOT_LABELS.get(str(key).lower()) == str(value).lower()


def _term_is_spot(term: dict) -> bool:
    for expression in (term or {}).get("matchExpressions") or []:
        if expression.get("operator") == "In" and any(
            _label_is_spot(expression.get("key", ""), v) for v in expression.get("values") or []
        ):
            return True
    return False


def is_spot_placed(node_selector: dict | None, affinity: dict | None) -> bool:
    if any(_label_is_spot(k, v) for k, v in (node_selector or {}).items()):
        return True
    node_affinity = (affinity or {}).get("nodeAffinity") or {}
    required = (node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms")
    if required and all(_term_is_spot(term) for term in required):
        return True
    preferred = node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    return any(_term_is_spot(p.get("preference") or {}) for p in preferred)


def placement(template: dict, spec: dict) -> dict:
    """The scheduling fields a pod of `template` gets: the template's, else the workflow's, with a
    podSpecPatch (template first, then workflow) merged over them."""
    out = {
        "nodeSelector": {**(spec.get("nodeSelector") or {}), **(template.get("nodeSelector") or {})},
        "affinity": template.get("affinity") or spec.get("affinity"),
        "tolerations": template.get("tolerations") or spec.get("tolerations"),
        "terminationGracePeriodSeconds": None,
    }
    for patch_text in (spec.get("podSpecPatch"), template.get("podSpecPatch")):
        if not patch_text:
            continue
        try:
            patch = yaml.safe_load(patch_text) if isinstance(patch_text, str) else patch_text
        except yaml.YAMLError:
            continue
        if isinstance(patch, dict):
            out["nodeSelector"].update(patch.get("nodeSelector") or {})
            for key in ("affinity", "tolerations", "terminationGracePeriodSeconds"):
                if patch.get(key) is not None:
                    out[key] = patch[key]
    return out


@dataclass
class Injection:
    kind: str  # "preempt" or "kill"
    delay: float  # seconds after the pod started
    phase: str
    message: str
    pod_name: str = ""
    node_name: str = ""
    fired: bool = False


@dataclass
class ChaosMonkey:
    spec: ChaosSpec
    rng: random.Random = field(init=False)
    remaining: dict[str, int] = field(init=False)
    skip: dict[str, int] = field(init=False)
    preemptions: int = 0
    log: list[Injection] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.spec.seed)
        self.remaining = {"preempt": self.spec.preempt, "kill": self.spec.kill}
        self.skip = {kind: self.rng.randint(0, 2) for kind in ("preempt", "kill")}

    def target(self, pod_name: str, node_name: str, spot: bool, eligible: bool) -> Injection | None:
        """Called at each pod start; returns the injection this pod will get, if any."""
        if not eligible:
            return None
        for kind in ("preempt", "kill"):
            if self.remaining[kind] <= 0 or (kind == "preempt" and not spot):
                continue
            if self.skip[kind] > 0:
                self.skip[kind] -= 1
                continue
            self.remaining[kind] -= 1
            self.skip[kind] = self.rng.randint(0, 2)
            delay = self.rng.uniform(0.2, 3.0)
            if kind == "kill":
                phase, message = ERROR, POD_DELETED
            else:
                phase, message = (ERROR, POD_DELETED) if self.preemptions % 2 == 0 else (FAILED, NODE_SHUTDOWN)
                self.preemptions += 1
            injection = Injection(kind, delay, phase, message, pod_name, node_name)
            self.log.append(injection)
            return injection
        return None

    def missed(self, injection: Injection) -> None:
        """The target finished first: hand the injection to the next eligible pod start."""
        self.log.remove(injection)
        self.remaining[injection.kind] += 1
        self.skip[injection.kind] = 0
        if injection.kind == "preempt":
            self.preemptions -= 1

    def summary(self) -> str:
        fired = [i for i in self.log if i.fired]
        counts = {k: sum(1 for i in fired if i.kind == k) for k in ("preempt", "kill")}
        text = f"chaos: {counts['preempt']}/{self.spec.preempt} preemptions, {counts['kill']}/{self.spec.kill} kills"
        if counts["preempt"] < self.spec.preempt or counts["kill"] < self.spec.kill:
            text += " (the rest found no eligible pod running long enough)"
        return text
