"""--chaos preempt=N[@TEMPLATE],kill=M[@TEMPLATE],seed=S: Spot reclaims and hard kills, recorded the way Argo
records them, each landing in the middle of a running attempt's work.

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
`@TEMPLATE` aims a kind of fault at the pods of one template (`preempt=3@rollout,kill=1@update`).

When: a seeded RNG picks, for each kind, how many eligible pod starts to let pass before the next target
(0-2), and where in the target's run to strike. A pod whose template reports its progress (the annotation
`workflows.argoproj.io/progress`; steps/progress.py) is struck at one of its progress reports, strictly
between its first and last unit of work where it has two units or more, whatever the machine's speed: it
stops itself there and the fault is delivered to the stopped process. Any other pod is struck 0.2-3 s after
its start. A target that ends before it is struck (nothing left to do, or a short pod) passes the injection
on to the next eligible pod start. A pod whose previous attempt was itself hit is never a target, so one retry
always meets a clean attempt. Exit handlers are never hit. Then the workflow's own retryStrategy decides what
is retried. A workflow that succeeds before every requested fault has landed is reported as an error
(ChaosMonkey.shortfall): a clean run is never passed off as a chaos run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import yaml

from pipelines.local.api.status import ERROR, FAILED
from steps.errors import MoerlError

SPOT_LABELS = {"karpenter.sh/capacity-type": "spot", "eks.amazonaws.com/capacitytype": "spot"}
POD_DELETED = "pod deleted"
NODE_SHUTDOWN = "Pod was terminated in response to imminent node shutdown."


KINDS = ("preempt", "kill")


@dataclass(frozen=True)
class ChaosSpec:
    preempt: int = 0
    kill: int = 0
    seed: int = 0
    preempt_at: str | None = None  # the template whose pods the preemptions aim at (None: any Spot-placed pod)
    kill_at: str | None = None  # the template whose pods the kills aim at (None: any pod)

    @property
    def enabled(self) -> bool:
        return self.preempt > 0 or self.kill > 0

    def aimed_at(self, kind: str) -> str | None:
        return self.preempt_at if kind == "preempt" else self.kill_at

    def __str__(self) -> str:
        parts = [
            f"{k}={getattr(self, k)}" + (f"@{self.aimed_at(k)}" if self.aimed_at(k) else "")
            for k in KINDS
            if getattr(self, k) or self.aimed_at(k)
        ]
        return ",".join([*parts, f"seed={self.seed}"])


def parse_chaos(text: str | None) -> ChaosSpec:
    """ "preempt=3@rollout,kill=1,seed=7" -> ChaosSpec(3, 1, 7, preempt_at="rollout")."""
    if not text:
        return ChaosSpec()
    values: dict[str, int | str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        value, at, template = value.strip().partition("@")
        ok = sep and key in ("preempt", "kill", "seed") and value.lstrip("-").isdigit()
        if not ok or (at and (key == "seed" or not template.strip())):
            raise MoerlError(
                f"--chaos {text!r}: expected preempt=N[@TEMPLATE],kill=M[@TEMPLATE],seed=S with integers, e.g. "
                f"preempt=3@rollout,kill=1,seed=7; {part.strip()!r} is not understood"
            )
        values[key] = int(value)
        if at:
            values[f"{key}_at"] = template.strip()
    if int(values.get("preempt", 0)) < 0 or int(values.get("kill", 0)) < 0:
        raise MoerlError(f"--chaos {text!r}: preempt and kill must be 0 or more")
    return ChaosSpec(**values)  # type: ignore[arg-type]


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
    delay: float  # seconds after the pod started, for a pod that does not report its progress
    fraction: float  # where in its reported work a pod that reports progress is struck (steps/progress.py)
    phase: str
    message: str
    pod_name: str = ""
    node_name: str = ""
    template: str = ""
    at_progress: bool = False  # struck at a progress report rather than after `delay`
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
        self.skip = {kind: self.rng.randint(0, 2) for kind in KINDS}

    def check_aims(self, templates: dict[str, dict], spot_templates: set[str]) -> None:
        """Refuse, before anything runs, an aim at a template the workflow lacks, or preemptions that no
        Spot-placed template could take."""
        for kind in KINDS:
            aim = self.spec.aimed_at(kind)
            if aim is not None and aim not in templates:
                raise MoerlError(
                    f"--chaos {self.spec}: {kind}@{aim}: the workflow has no template {aim!r}; "
                    f"aim at one of {', '.join(sorted(templates))}"
                )
        aim = self.spec.preempt_at
        if self.spec.preempt > 0 and (not spot_templates or (aim is not None and aim not in spot_templates)):
            which = f"template {aim!r} is not" if aim else "no template of this workflow is"
            raise MoerlError(
                f"--chaos {self.spec}: {which} Spot-placed, so no pod could be reclaimed; ask for kills "
                "instead, or place the template on Spot nodes (nodeSelector karpenter.sh/capacity-type: spot)"
            )

    def target(
        self, pod_name: str, node_name: str, spot: bool, eligible: bool, template: str = "",
        reports_progress: bool = False,
    ) -> Injection | None:  # fmt: skip
        """Called at each pod start; returns the injection this pod will get, if any."""
        if not eligible:
            return None
        for kind in KINDS:
            aim = self.spec.aimed_at(kind)
            if self.remaining[kind] <= 0 or (kind == "preempt" and not spot) or (aim is not None and aim != template):
                continue
            if self.skip[kind] > 0:
                self.skip[kind] -= 1
                continue
            self.remaining[kind] -= 1
            self.skip[kind] = self.rng.randint(0, 2)
            delay, fraction = self.rng.uniform(0.2, 3.0), self.rng.random()
            if kind == "kill":
                phase, message = ERROR, POD_DELETED
            else:
                phase, message = (ERROR, POD_DELETED) if self.preemptions % 2 == 0 else (FAILED, NODE_SHUTDOWN)
                self.preemptions += 1
            injection = Injection(
                kind, delay, fraction, phase, message, pod_name, node_name, template, at_progress=reports_progress
            )
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

    def landed(self) -> dict[str, int]:
        return {kind: sum(1 for i in self.log if i.fired and i.kind == kind) for kind in KINDS}

    def summary(self) -> str:
        landed = self.landed()
        return f"chaos: {landed['preempt']}/{self.spec.preempt} preemptions, {landed['kill']}/{self.spec.kill} kills"

    def shortfall(self) -> str | None:
        """What was asked for and never landed, as an error message; None when every fault landed."""
        landed = self.landed()
        if landed["preempt"] >= self.spec.preempt and landed["kill"] >= self.spec.kill:
            return None
        return (
            f"--chaos {self.spec}: the workflow ended with {landed['preempt']} of {self.spec.preempt} "
            f"preemptions and {landed['kill']} of {self.spec.kill} kills landed, so it is not the chaos run asked "
            "for; no further eligible pod started (not an exit handler, not the retry of a hit attempt, "
            "Spot-placed for a preemption, of the aimed template); ask for fewer faults or aim them with @TEMPLATE"
        )
