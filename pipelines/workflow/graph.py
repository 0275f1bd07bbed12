"""The shape of a run: segments of unrolled iterations and the dependencies between their tasks.

Pure data, no Hera: the builders turn it into an Argo DAG and the KFP pipeline into `.after()` calls, and the
tests read it directly.

Per iteration i there are four tasks: rollout-i (fanned out over shards), score-i, update-i, publish-i.
rollout-i samples from policy v(i-1-staleness) (steps.run.keys.behaviour_version) and so waits for
publish-(i-1-staleness):

    staleness 0:  publish-(i-1) -> rollout-i -> score-i -> update-i -> publish-i       (synchronous)
    staleness 1:  publish-(i-2) -> rollout-i -> score-i ─┐
                                      publish-(i-1) ─────┴-> update-i -> publish-i
                  so rollout-(i+1) runs while update-i trains.

With rollout servers and checkpoint deltas (steps/run/weight_delta.py wanted), a version is usable once its
update has indexed its delta, before publish has written the full checkpoint: rollout-i then waits for
update-(i-1-staleness) instead of publish-(i-1-staleness), and publish-(i-1) runs beside rollout-i:

    staleness 0:  update-(i-1) -> rollout-i -> score-i ─┐
                  update-(i-1) -> publish-(i-1) ────────┴-> update-i -> publish-i

With the trainer that stays up as well (trainer.server), the trainer holds v(i-1) and its optimizer state in
memory, so update-i waits for update-(i-1), not for publish-(i-1) (a trainer restarted meanwhile, which does
not hold it, waits for that publish: steps/training/trainer_server.py); each publish waits for the one before
it (publish-i reads v(i-1) as published), and update-i for publish-(i-2), so publishing never falls more than
one version behind the trainer and an indexed version's nearest published ancestor is at most two back:

    update-(i-1) -> update-i -> update-(i+1)           the trainer's path: training and candidates only
    publish-(i-2) ──────────────┘                      publishes beside it, at most one version behind

A run longer than `segment_size` iterations is split into segments, one Workflow each (Argo keeps a whole
Workflow, status included, in one etcd object of about 1 MB). Every segment starts with `plan`, which reads
LATEST; tasks of iterations already published are skipped, so any segment resumes where the run stopped.
The first segment also imports the SFT checkpoint (when there is no LATEST yet); every segment but the last
ends by submitting the next one.

Every segment has the same shape, the first segment's (`template_shape`): on a cluster one WorkflowTemplate
runs them all, its tasks named by their position in the segment (`rollout-1` is the segment's first
iteration) and its first iteration a parameter (pipelines/workflow/templates.py `Numbering`). The self-contained
Workflow is the whole run as one segment, where a task's position is its iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from steps.run import weight_delta
from steps.run.config import RunConfig
from steps.run.keys import behaviour_version

PLAN = "plan"
IMPORT_SFT = "import-sft"
NEXT_SEGMENT = "next-segment"
REPORT = "report"
ROLLOUT_SERVER = "rollout-server"  # the template of a segment's long-lived rollout servers (rollout.servers)
TRAINER_SERVER = "trainer-server"  # the template and task of a segment's trainer that stays up (trainer.server)
STEPS = ("rollout", "score", "update", "publish")


@dataclass(frozen=True)
class Segment:
    index: int  # 0-based
    count: int  # segments in the run
    first: int  # first iteration (1-based)
    last: int  # last iteration, inclusive

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def iterations(self) -> range:
        return range(self.first, self.last + 1)


def segments(iterations: int, segment_size: int) -> list[Segment]:
    count = -(-iterations // segment_size)
    return [Segment(k, count, k * segment_size + 1, min((k + 1) * segment_size, iterations)) for k in range(count)]


def template_shape(iterations: int, segment_size: int) -> Segment:
    """The shape of every segment's Workflow: the first segment's positions (1..min(segment_size, iterations)),
    with a next-segment task when the run has more than one segment. A later segment has the same tasks: its
    iterations before the first one it can sample for depend on `plan` through import-sft, which it skips."""
    return segments(iterations, segment_size)[0]


def whole_run(iterations: int) -> Segment:
    """All iterations as one segment: the self-contained Workflow that the local executor runs."""
    return Segment(0, 1, 1, iterations)


def task_name(step: str, iteration: int) -> str:
    return f"{step}-{iteration}"


def run_dependencies(
    segment: Segment, cfg: RunConfig, servers_run: bool, staleness: int | None = None
) -> dict[str, list[str]]:
    """dependencies() for a run's config (its staleness unless given): where the orchestrator runs long-lived
    servers (`servers_run`: Argo's daemons; KFP has none, its steps open engines and trainers of their own),
    versions are read before publish where the run writes deltas for rollout servers (steps/run/weight_delta.py
    wanted), and the trainer holds them where it also stays up."""
    indexed = servers_run and weight_delta.wanted(cfg)
    staleness = cfg.staleness if staleness is None else staleness
    return dependencies(segment, staleness, indexed, trainer_holds_versions=indexed and cfg.trainer.server)


def dependencies(
    segment: Segment, staleness: int, indexed_versions: bool = False, trainer_holds_versions: bool = False
) -> dict[str, list[str]]:
    """Task name -> the tasks it waits for, in topological order; only edges not implied by others are kept.
    indexed_versions: rollout waits for the update that indexed its version, not for its publish;
    trainer_holds_versions: so does the next update, and publishes follow each other (module docstring)."""
    made_usable_by = "update" if indexed_versions else "publish"
    trained_from = "update" if trainer_holds_versions else "publish"
    deps: dict[str, list[str]] = {PLAN: []}
    start = PLAN
    if segment.is_first:
        deps[IMPORT_SFT] = [PLAN]
        start = IMPORT_SFT
    ancestors: dict[str, set[str]] = {}

    def add(task: str, wanted: list[str]) -> None:
        # Drop a dependency that another dependency already implies: the graph reads as intended.
        needed = [d for d in wanted if not any(d in _closure(o, deps, ancestors) for o in wanted if o != d)]
        deps[task] = needed

    for i in segment.iterations:
        source = behaviour_version(i, staleness)
        add(task_name("rollout", i), [task_name(made_usable_by, source)] if source >= segment.first else [start])
        add(task_name("score", i), [task_name("rollout", i)])
        previous = i - 1 >= segment.first
        behind = [task_name("publish", i - 2)] if trainer_holds_versions and i - 2 >= segment.first else []
        add(
            task_name("update", i),
            [task_name("score", i), *([task_name(trained_from, i - 1)] if previous else []), *behind],
        )
        add(task_name("publish", i), [task_name("update", i), *([task_name("publish", i - 1)] if previous else [])])
    if not segment.is_last:
        deps[NEXT_SEGMENT] = [task_name("publish", segment.last)]
    return deps


def _closure(task: str, deps: dict[str, list[str]], memo: dict[str, set[str]]) -> set[str]:
    """All ancestors of `task`."""
    if task not in memo:
        found: set[str] = set()
        for parent in deps.get(task, []):
            found.add(parent)
            found |= _closure(parent, deps, memo)
        memo[task] = found
    return memo[task]


def ancestors(task: str, deps: dict[str, list[str]]) -> set[str]:
    return _closure(task, deps, {})
