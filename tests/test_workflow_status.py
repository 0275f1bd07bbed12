"""The one reader of an Argo Workflow status (steps/tracking/workflow_status.py): each node's step, iteration, attempt
and times, from a status, a whole Workflow object or compressed nodes."""

from __future__ import annotations

import base64
import gzip
import json
from datetime import UTC, datetime

from steps.tracking.workflow_status import status_nodes, step_nodes

NODES = {
    "wf-1": {"name": "wf", "displayName": "wf", "type": "DAG", "phase": "Succeeded"},
    "wf-2": {"name": "wf.plan", "displayName": "plan", "type": "Retry", "templateName": "plan"},
    "wf-3": {"name": "wf.rollout-3(0:1)(2)", "displayName": "rollout-3(0:1)(2)", "type": "Pod",
             "phase": "Succeeded", "templateName": "rollout",
             "startedAt": "2026-12-01T10:00:00Z", "finishedAt": "2026-12-01T10:00:07Z"},  # fmt: skip
    "wf-4": {"name": "wf.publish-3", "displayName": "publish-3", "type": "Retry", "phase": "Running"},
}


def test_each_node_is_read_as_its_step_iteration_attempt_and_times():
    nodes = {n.display_name: n for n in step_nodes({"nodes": NODES})}
    shard = nodes["rollout-3(0:1)(2)"]
    assert (shard.step, shard.iteration, shard.attempt, shard.type, shard.template) == (
        "rollout", 3, "(0:1)(2)", "Pod", "rollout")  # fmt: skip
    assert (shard.finished - shard.started).total_seconds() == 7.0
    assert shard.started == datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
    publish = nodes["publish-3"]
    assert (publish.step, publish.iteration, publish.attempt, publish.finished) == ("publish", 3, "", None)
    assert (nodes["plan"].step, nodes["plan"].iteration) == (None, None)


def test_a_whole_workflow_object_and_compressed_nodes_read_as_the_plain_status():
    packed = base64.b64encode(gzip.compress(json.dumps(NODES).encode())).decode()
    assert status_nodes({"status": {"nodes": NODES}}) == NODES
    assert status_nodes({"compressedNodes": packed}) == NODES
    assert status_nodes({"offloadNodeStatusVersion": "abc"}) == {}
    assert step_nodes({"status": {"compressedNodes": packed}}) == step_nodes({"nodes": NODES})


def test_a_later_segments_node_is_read_at_its_iteration_input_not_its_position():
    """A segment's tasks are named by their position (rollout-2 of the segment that starts at 41); the node's
    `iteration` input says which iteration it worked on."""
    inputs = {"parameters": [{"name": "iteration", "value": "42"}, {"name": "shard", "value": "0"}]}
    node = {"name": "seg.rollout-2(0:0)", "displayName": "rollout-2(0:0)", "type": "Pod", "templateName": "rollout",
            "inputs": inputs}  # fmt: skip
    (read,) = step_nodes({"nodes": {"seg-1": node}})
    assert (read.step, read.iteration, read.attempt) == ("rollout", 42, "(0:0)")
