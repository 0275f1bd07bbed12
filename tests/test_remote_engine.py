"""A multi-turn rollout client's engine over HTTP (steps/engines/remote.py): a rollout server's `generate` answers
a turn's samples with the generations the server's own engine gives them, exactly as a torch engine of the
client's would, and refuses a request for another version, another run or more tokens than a turn has."""

import dataclasses

import pytest
import torch
from experience_helpers import make_run, tiny_model, write_checkpoint
from test_rollout_server import WORKFLOW, start_server, stop, wait_ready

from steps.engines.interface import GenerationRequest, sample_seed
from steps.engines.remote import RemoteEngine
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.experience.rollout_chunks import IterationRollout
from steps.run import serving
from steps.store.object_store import Store

CONFIG = dict(prompts_per_iteration=4, group_size=2, rollout={"num_shards": 1, "chunk_size": 2, "servers": 1},
              sampling={"max_new_tokens": 10}, heldout_size=0)  # fmt: skip


def test_a_servers_generations_are_the_clients_own_engines(tmp_path):
    checkpoint_dir = write_checkpoint(tiny_model(seed=2), tmp_path / "v0")
    run = make_run(tmp_path, checkpoint_dir, **CONFIG)
    work = IterationRollout.open(Store.open(run), 1)
    # a later turn: contexts of different lengths, each with its own seed, 6 tokens allowed
    requests = [GenerationRequest(f"p{i}", tuple(range(3, 8 + 2 * i)), k, sample_seed(0, 1, f"p{i}", k))
                for i in range(3) for k in range(2)]  # fmt: skip
    params = dataclasses.replace(work.plan.sampling, n=1, max_new_tokens=6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's (--threads 1): the same thread count gives the same bits
    try:
        expected = TorchEngine.from_checkpoint(checkpoint_dir).generate(requests, params)
    finally:
        torch.set_num_threads(threads)
    server = start_server(run, "rollout-server-0")
    try:
        wait_ready(run, {"rollout-server-0"}, [server])
        [entry] = serving.live_servers(Store.open(run), WORKFLOW, "rollout-server-")
        got = RemoteEngine(entry, Store.open(run).uri, 1, work.version).generate(requests, params)
        assert [(g.response_ids, g.finish_reason) for g in got] == [(g.response_ids, g.finish_reason) for g in expected]
        assert [g.logprobs for g in got] == [g.logprobs for g in expected]  # float32 through JSON: exact
        assert all(len(g.response_ids) <= 6 for g in got)

        with pytest.raises(MoerlError, match="samples from v000000"):
            RemoteEngine(entry, Store.open(run).uri, 1, 3).generate(requests, params)
        with pytest.raises(MoerlError, match="this server serves"):
            RemoteEngine(entry, "file:///elsewhere", 1, 0).generate(requests, params)
        with pytest.raises(MoerlError, match="max_new_tokens 11 is outside 1..10"):
            RemoteEngine(entry, Store.open(run).uri, 1, 0).generate(
                requests, dataclasses.replace(params, max_new_tokens=11)
            )
        with pytest.raises(MoerlError, match="needs requests"):
            serving.call(entry, "generate", {"run": Store.open(run).uri, "iteration": 1, "policy_version": 0,
                                             "requests": [["p0", [3, 4]]], "max_new_tokens": 4})  # fmt: skip
    finally:
        stop(server)
