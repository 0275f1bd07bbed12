"""A rollout server's work: one engine, one policy version at a time, chunks generated on request.

A `chunk` request names the run, the iteration, the chunk and the policy version that must generate it. The
server refuses a request for another run, or for a version the iteration does not sample from; otherwise it
brings its engine to that version (in place, from the run store: steps/engines/weight_sync.py), generates the chunk
and writes it, exactly as a rollout step would, and answers with what it did. It never answers with samples
of another version than the one asked for: the version check happens before the engine is touched, and the
chunk's rows carry the version that generated them.

An in-place update that leaves the engine broken (SGLang's failed load: its weights are then no version's,
steps/engines/sglang_engine.py) is answered 503, which the client retries, and the engine is closed; between
requests the server opens a new one from the run store on that version (recover), answering every request
with 503 and saying it is not ready until then, and trying again every REOPEN_RETRY_S if the open fails.

Progress (for Argo's UI and `moerl local --chaos`, steps/progress.py) counts each request as two units,
generated and written, over the requests received so far: a struck server stops between the two, with the
chunk generated and not written, which is the worst moment to lose it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from steps import progress
from steps.engines import remote
from steps.engines.interface import Engine, GenerationInterrupted
from steps.engines.weight_sync import WeightSync
from steps.errors import MoerlError
from steps.experience.rollout_chunks import IterationRollout, engine_settings, open_engine
from steps.run import checkpoint
from steps.run.config import load_run_config
from steps.run.keys import behaviour_version
from steps.run.serving import Unavailable
from steps.store.object_store import Store

VERSION_POLL_S = 0.5  # how often a server that starts before v000000 exists looks for it
REOPEN_RETRY_S = 30.0  # how long a server whose engine could not be reopened waits before it tries again


class RolloutService:
    def __init__(self, run: Store, name: str, device: str = "cpu", log: Callable[[str], None] = print) -> None:
        self.run = run
        self.name = name
        self.device = device
        self.log = log
        self.cfg = load_run_config(run)
        self.sync = WeightSync(run, log=log)
        self.engine: Engine | None = None
        self.version: int | None = None  # the policy version the engine holds
        self.instance = ""  # set by the step once registered
        self.stopping = threading.Event()  # SIGTERM: the request in flight stops between decode steps
        self.reopen: int | None = None  # the version to open a new engine on (the last one broke), if any
        self._reopen_at = 0.0  # time.monotonic() of the next try
        self._iterations: dict[int, IterationRollout] = {}
        self._received = 0
        self._done = 0

    # ------------------------------------------------------------------------------- state

    def start(self) -> bool:
        """Open the engine on the version the run's next iteration samples from, waiting for import-sft's
        v000000 when there is none yet (a server's pod starts with the segment, so that its node, image and
        imports overlap the import). A server is ready once its engine is; False if told to stop first."""
        said = False
        while (latest := checkpoint.latest_version(self.run)) is None:
            if not said:
                self.log(f"{self.name}: waiting for the run's first published version (import-sft)")
                said = True
            if self.stopping.wait(VERSION_POLL_S):
                return False
        version = behaviour_version(latest + 1, self.cfg.staleness)  # what the next iteration samples from
        self._open(version)
        return True

    def _open(self, version: int) -> None:
        """A new engine on `version`, from its dir in the node cache (fetched from the run store if need be)."""
        settings = engine_settings(self.cfg)
        self.engine = self.sync.open(
            version, lambda d: open_engine(self.cfg.rollout.engine, d, self.device, settings, self.cfg.records_routes)
        )
        self.version = version
        self.log(f"{self.name}: {self.cfg.rollout.engine} engine ready with v{version:06d}")

    def unavailable(self) -> str | None:
        """Why a request would be answered 503 now, without being run (the engine is being reopened)."""
        if self.reopen is None:
            return None
        return f"{self.name} is opening a new engine on v{self.reopen:06d} after a failed in-place update"

    def recover(self) -> None:
        """Between requests: open a new engine on self.reopen when the last one broke (module docstring)."""
        if self.reopen is None or self.stopping.is_set() or time.monotonic() < self._reopen_at:
            return
        version = self.reopen
        try:
            self._open(version)
        except Exception as err:  # noqa: BLE001 - the server stays up and not ready, and tries again
            self.engine = None
            self._reopen_at = time.monotonic() + REOPEN_RETRY_S
            self.log(
                f"{self.name}: could not open a new engine on v{version:06d} ({type(err).__name__}: {err}); "
                f"trying again in {REOPEN_RETRY_S:.0f}s"
            )
            return
        self.reopen = None

    def health(self) -> dict[str, Any]:
        return {
            "run": self.run.uri,
            "instance": self.instance,
            "ready": self.engine is not None and not self.stopping.is_set(),
            "version": self.version,
            "requests": self._done,
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def bring_to(self, version: int) -> None:
        """Make the engine hold `version`, in place: the version's delta (or whole checkpoint) fetched once per
        node, its weights copied into the engine (steps/engines/weight_sync.py)."""
        if self.version == version:
            return
        assert self.engine is not None
        try:
            result = self.sync.bring(self.engine, self.version, version)
        except MoerlError as err:
            broken = getattr(self.engine, "broken", None)
            if broken is None:  # refused before the engine was touched: the request fails the same anywhere
                raise
            self._discard_engine(version)
            raise Unavailable(f"{err}; {self.name} opens a new engine on v{version:06d} from the run store") from err
        self.log(
            f"{self.name}: v{self.version:06d} -> v{version:06d} in place ({result.path}, "
            f"{result.bytes_fetched / 1e6:.1f} MB fetched, {result.seconds:.2f}s)"
        )
        self.version = version

    def _discard_engine(self, reopen: int) -> None:
        """Close a broken engine (freeing its GPU memory for the next) and have recover open one on `reopen`."""
        engine, self.engine, self.version = self.engine, None, None
        self.reopen, self._reopen_at = reopen, 0.0
        try:
            if engine is not None:
                engine.close()
        except Exception as err:  # noqa: BLE001 - the new engine is what matters; say why this one lingers
            self.log(f"{self.name}: closing the broken engine failed ({type(err).__name__}: {err})")

    # ------------------------------------------------------------------------------- requests

    def _iteration(self, iteration: int) -> IterationRollout:
        """The iteration's plan and tokenizer, read once; two iterations are in flight at most (staleness 1)."""
        if iteration not in self._iterations:
            self._iterations[iteration] = IterationRollout.open(self.run, iteration, self.cfg)
            for old in sorted(self._iterations)[:-2]:
                del self._iterations[old]
        return self._iterations[iteration]

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """The `generate` operation (steps/engines/remote.py): one turn of a multi-turn chunk, whose rollout client
        runs the environment. {run, iteration, policy_version, requests, max_new_tokens} -> the generations."""
        if request.get("run") != self.run.uri:
            raise MoerlError(f"request for run {request.get('run')!r}: this server serves {self.run.uri}")
        try:
            iteration, version = int(request["iteration"]), int(request["policy_version"])
        except (KeyError, TypeError, ValueError) as err:
            raise MoerlError(f"generate request: needs integer iteration and policy_version ({err})") from err
        work = self._iteration(iteration)
        work.check_version(version, flag="policy_version")
        requests, params = remote.read_requests(request, work.plan.sampling)
        if (reason := self.unavailable()) is not None:
            raise Unavailable(reason)
        self.bring_to(version)
        assert self.engine is not None
        try:
            generations = self.engine.generate(requests, params, should_stop=self.stopping.is_set)
        except GenerationInterrupted as err:
            raise Unavailable(f"{self.name} is stopping: a turn of iteration {iteration} not generated ({err})") \
                from err
        return remote.answer_body(generations) | {"policy_version": version, "server": self.name}

    def chunk(self, request: dict[str, Any]) -> dict[str, Any]:
        """The `chunk` operation: {run, iteration, chunk, policy_version} -> what was done."""
        if request.get("run") != self.run.uri:
            raise MoerlError(f"request for run {request.get('run')!r}: this server serves {self.run.uri}")
        try:
            iteration, chunk, version = (int(request[k]) for k in ("iteration", "chunk", "policy_version"))
        except (KeyError, TypeError, ValueError) as err:
            raise MoerlError(f"chunk request {request}: needs integer iteration, chunk, policy_version") from err
        work = self._iteration(iteration)
        work.check_version(version, flag="policy_version")
        if not 0 <= chunk < work.plan.num_chunks:
            raise MoerlError(f"chunk {chunk}: iteration {iteration} has chunks 0..{work.plan.num_chunks - 1}")
        self._received += 1
        progress.report(2 * self._done, 2 * self._received)
        answer: dict[str, Any] = {"chunk": chunk, "policy_version": version, "server": self.name}
        if work.finished([chunk]):  # a retried request whose chunk another attempt wrote
            self._done += 1
            progress.report(2 * self._done, 2 * self._received)
            return answer | {"generated": False}
        if (reason := self.unavailable()) is not None:  # queued before recover ran
            raise Unavailable(reason)
        self.bring_to(version)
        assert self.engine is not None
        try:
            stats = work.generate(
                self.engine,
                chunk,
                should_stop=self.stopping.is_set,
                before_write=lambda: progress.report(2 * self._done + 1, 2 * self._received),
            )
        except GenerationInterrupted as err:
            raise Unavailable(f"{self.name} is stopping: chunk {chunk} not generated ({err})") from err
        self._done += 1
        progress.report(2 * self._done, 2 * self._received)
        self.log(
            f"{self.name}: iteration {iteration} chunk {chunk:06d} with v{version:06d}: {stats.samples} samples, "
            f"{stats.tokens} tokens in {stats.seconds:.1f}s"
        )
        return answer | {"generated": True} | asdict(stats)
