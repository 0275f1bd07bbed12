"""Scoring overlaps rollout (steps/scoring/verdicts.py): the verifier's verdicts a rollout client writes as each
chunk lands are what score uses for that chunk, and the scored experience is the same bytes with and without
them; verdicts of another chunk (a digest that differs), under other verifier settings, or unreadable are
ignored and the chunk is verified in score."""

import json

import pytest
from experience_helpers import make_run, tiny_model, write_checkpoint
from test_score import CONFIG, EXPECTED_CORRECT, write_hand_made_rollout

import steps.rollout as rollout_step
import steps.scoring.verdicts as verdicts_module
from steps.experience.rollout_chunks import IterationRollout, Preempted, Preemption
from steps.experience.rollout_plan import read_rollout, version_tokenizer
from steps.run.config import load_run_config
from steps.run.keys import scored_key, verdicts_key
from steps.score import score_iteration
from steps.scoring.verdicts import sample_verdicts, verify_table, write_chunk_verdicts
from steps.store.object_store import Store


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tiny_model(seed=8), tmp_path_factory.mktemp("policy") / "v0")


def scored(tmp_path, checkpoint_dir, name, verdicts=(), edit=None):
    """score_iteration's bytes for the hand-made rollout, with verdicts written first for `verdicts`' chunks."""
    run_uri = make_run(tmp_path / name, checkpoint_dir, **CONFIG)
    run = Store.open(run_uri)
    plan = write_hand_made_rollout(run_uri)
    cfg = load_run_config(run)
    for chunk in verdicts:
        write_chunk_verdicts(run, cfg, plan, version_tokenizer(run, 0), chunk)
    if edit is not None:
        edit(run)
    lines = []
    score_iteration(run_uri, 1, metrics_out=None, heldout=False, log=lines.append)
    return run.get_bytes(scored_key(1)), lines


def test_the_chunks_verdicts_give_the_same_scored_bytes_as_verifying_in_score(tmp_path, checkpoint_dir):
    alone, said = scored(tmp_path, checkpoint_dir, "alone")
    assert not any("verified by the rollout clients" in line for line in said)
    for chunks in ((0,), (0, 1)):
        overlapped, said = scored(tmp_path, checkpoint_dir, f"chunks-{len(chunks)}", verdicts=chunks)
        assert overlapped == alone
        assert f"{8 * len(chunks)} of 16 samples verified by the rollout clients" in " ".join(said)


def flip_correct(run: Store, chunk: int = 0, keep_digest: bool = True, **changes) -> None:
    record = json.loads(run.get_bytes(verdicts_key(1, chunk)))
    record["correct"] = [not c for c in record["correct"]]
    if not keep_digest:
        record["chunk_sha256"] = "0" * 64
    record.update(changes)
    run.put_bytes(verdicts_key(1, chunk), json.dumps(record).encode())


def test_score_uses_a_chunks_verdicts_only_while_they_describe_that_chunk(tmp_path, checkpoint_dir):
    run_uri = make_run(tmp_path / "run", checkpoint_dir, **CONFIG)
    run = Store.open(run_uri)
    plan = write_hand_made_rollout(run_uri)
    cfg = load_run_config(run)
    for chunk in (0, 1):
        write_chunk_verdicts(run, cfg, plan, version_tokenizer(run, 0), chunk)
    tok = version_tokenizer(run, 0)
    table = read_rollout(run, plan, 2)
    verified = [int(c) for c in verify_table(tok, table, cfg)[0]]  # the verifier itself, every row
    assert sorted(verified) == sorted(c for group in EXPECTED_CORRECT for c in group)
    in_chunk_0 = {p.prompt_id for p in plan.chunk_prompts(0)}
    prompt_ids = table.column("prompt_id").to_pylist()
    flipped = [1 - c if p in in_chunk_0 else c for c, p in zip(verified, prompt_ids, strict=True)]

    def correct_now():
        correct, _, read = sample_verdicts(run, cfg, plan, tok, table)
        return [int(c) for c in correct], read

    assert correct_now() == (verified, 16)
    flip_correct(run)  # the same chunk, other verdicts: they are the ones used (score reads them)
    assert correct_now() == (flipped, 16)
    for stale in ({"keep_digest": False}, {"verifier": "math"}, {"answer_pattern": "X(.*)"}):
        write_chunk_verdicts(run, cfg, plan, tok, 0)
        flip_correct(run, **stale)  # another chunk's, or other settings': verified in score
        assert correct_now() == (verified, 8), stale
    run.put_bytes(verdicts_key(1, 0), b"{not json")
    assert correct_now() == (verified, 8)


def test_a_client_interrupted_or_failing_while_verifying_leaves_the_chunk_to_score(
    tmp_path, checkpoint_dir, monkeypatch
):
    """A SIGTERM during verification (which a verifier's own `except Exception` may swallow) writes no verdicts
    and stops the step; any other failure is said and the step goes on: score verifies that chunk."""

    run_uri = make_run(tmp_path / "run", checkpoint_dir, **CONFIG)
    run = Store.open(run_uri)
    write_hand_made_rollout(run_uri)
    work = IterationRollout.open(run, 1)
    preemption = Preemption()

    real_verify = verdicts_module.verify_table

    def swallowed_sigterm(*args):
        preemption.requested = True  # the handler ran; the verifier caught Preempted and returned its default
        return real_verify(*args)

    monkeypatch.setattr(verdicts_module, "verify_table", swallowed_sigterm)
    with pytest.raises(Preempted):
        rollout_step.verdicts(work, 0, preemption, print, "shard 0")
    assert not run.exists(verdicts_key(1, 0))

    lines = []
    monkeypatch.setattr(verdicts_module, "verify_table", lambda *a: 1 / 0)
    rollout_step.verdicts(work, 1, Preemption(), lines.append, "shard 1")
    assert not run.exists(verdicts_key(1, 1))
    assert lines == [
        "shard 1: chunk 000001: verdicts not written (ZeroDivisionError: division by zero); score verifies it"
    ]
