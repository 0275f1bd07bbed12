"""bench/profile_demo.py: a step's parts add up to its wall time, and stacks are filed under the right category."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_demo", REPO / "bench" / "profile_demo.py")
profile_demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_demo)


def record(pid, argv, hook, exit, segments, children=(), rank=None):
    return {"pid": pid, "argv": argv, "hook": hook, "exit": exit, "segments": segments, "imports": {},
            "children": list(children), "rank": rank}  # fmt: skip


def test_plain_step_parts_sum_to_its_wall():
    pod = {"pid": 10, "argv": ["python", "-m", "steps.score"], "spawn": 100.0, "exit_seen": 110.0}
    main = record(10, ["python", "-m", "steps.score", "--iteration", "1"], 100.3, 109.0,
                  [[100.3, 104.0, "imports"], [104.0, 105.0, "model load"], [105.0, 109.0, "work"]])  # fmt: skip
    parts = profile_demo.breakdown(pod, {10: main})
    expected = {"start-up": 0.3, "imports": 3.7, "model load": 1.0, "work": 4.0, "shutdown": 1.0}
    assert parts.keys() == expected.keys()
    assert all(abs(parts[k] - v) < 1e-9 for k, v in expected.items())
    assert abs(sum(parts.values()) - 10.0) < 1e-9


def test_torchrun_step_splits_agent_and_rank0_and_sums_to_its_wall():
    pod = {"pid": 20, "spawn": 0.0, "exit_seen": 30.0}
    workers = [{"pid": 21, "spawn": 5.0, "exit_seen": 26.0}, {"pid": 22, "spawn": 5.1, "exit_seen": 26.0}]
    agent = record(20, ["python", "torchrun", "-m", "steps.update", "--iteration", "1"], 0.2, 27.0,
                   [[0.2, 4.0, "imports"], [4.0, 27.0, "work"]], workers)  # fmt: skip
    rank0 = record(21, ["python", "-u", "-m", "steps.update"], 5.5, 25.0,
                   [[5.5, 15.0, "imports"], [15.0, 16.0, "dist init"], [16.0, 25.0, "work"]], rank="0")  # fmt: skip
    rank1 = record(22, ["python", "-u", "-m", "steps.update"], 5.6, 25.0, [[5.6, 25.0, "work"]], rank="1")
    parts = profile_demo.breakdown(pod, {20: agent, 21: rank0, 22: rank1})
    assert abs(parts["torchrun agent"] - (5.0 + 4.0)) < 1e-9  # before rank 0's spawn and after its exit
    assert abs(parts["start-up"] - 0.5) < 1e-9  # rank 0's
    assert abs(parts["imports"] - 9.5) < 1e-9
    assert abs(parts["dist init"] - 1.0) < 1e-9
    assert abs(parts["shutdown"] - 1.0) < 1e-9  # rank 0's teardown until the agent saw it exit
    assert abs(sum(parts.values()) - 30.0) < 1e-9


def test_a_running_import_is_filed_under_imports_with_the_third_party_module():
    found = {}

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == "colorsys" and not found:
                found["sample"] = profile_demo.classify(sys._getframe())
            return None

    sys.meta_path.insert(0, Finder())
    try:
        sys.modules.pop("colorsys", None)
        import colorsys  # noqa: F401
    finally:
        sys.meta_path.pop(0)
    assert found["sample"] == ("imports", "colorsys")


def test_frames_in_the_store_are_store_io_and_the_rest_is_work():
    def from_store():
        return profile_demo.classify(sys._getframe())

    from_store.__code__ = from_store.__code__.replace(co_filename="/x/steps/store/object_store.py")
    assert from_store() == ("store I/O", None)
    assert profile_demo.classify(sys._getframe()) == ("work", None)
