"""Every input surface, given bad input: config fields, command-line flags, SFT checkpoints, prompt files,
experience files, store URIs, credentials and manifests handed to `moerl local`. Each case pins the message the
user gets (a substring of the one `error: ...`), exit code 2, no traceback, and that nothing was published.

The commands run in this process through their real entry points (pipelines.cli.main, each step's main under
steps.errors.run_cli), so a case costs milliseconds. Deeper tables per surface live next to each module
(test_config.py, test_import_sft.py, test_prompt_file.py, test_score.py, test_update_experience.py,
test_store_s3.py, test_local_manifest_validation.py); this file is the one place that walks all of them.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import yaml
from experience_helpers import make_run, tiny_model, write_checkpoint
from safetensors.torch import load_file, save_file
from test_score import CONFIG as SCORE_CONFIG
from test_score import write_hand_made_rollout
from test_update_experience import experience_table, write_experience

import pipelines.cli
from steps import import_sft, publish, rollout, score, update
from steps.errors import run_cli
from steps.experience.tables import read_table, table_bytes
from steps.run import checkpoint
from steps.run.keys import chunk_key, scored_key
from steps.store.object_store import Store

# --- running a command -----------------------------------------------------------------------------------


def outcome(main: Callable[[], None], argv: list[str], monkeypatch, capsys) -> tuple[int | str, str]:
    """(exit code, stderr) of a command line; an exception that escapes is returned as its traceback."""
    monkeypatch.setattr(sys, "argv", argv)
    try:
        main()
        code: int | str = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except Exception:  # what a user would see as a traceback: always a failure of these tests
        code = "traceback"
        return code, capsys.readouterr().err + traceback.format_exc()
    return code, capsys.readouterr().err


def moerl(args: list[str], monkeypatch, capsys) -> tuple[int | str, str]:
    return outcome(lambda: pipelines.cli.main(args), ["moerl", *args], monkeypatch, capsys)


def step(module, args: list[str], monkeypatch, capsys) -> tuple[int | str, str]:
    return outcome(lambda: run_cli(module.main), [f"python -m {module.__name__}", *args], monkeypatch, capsys)


def assert_refused(result: tuple[int | str, str], message: str) -> None:
    """Exit code 2, one `error: ...` (or argparse's usage error) that contains `message`, no traceback."""
    code, err = result
    assert code == 2, f"exit {code}:\n{err}"
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ") or ": error: " in line]
    assert len(errors) == 1, err
    assert message in err, f"expected {message!r} in:\n{err}"


def nothing_published(run_uri: str) -> None:
    """The run store holds what import-sft left and nothing more: v000000, LATEST, run.json."""
    run = Store.open(run_uri)
    assert checkpoint.published_versions(run) == [0] and checkpoint.read_latest(run) == "v000000"
    extra = [k for k in run.list() if not k.startswith("checkpoints/v000000/") and k not in ("checkpoints/LATEST",
                                                                                             "run.json")]  # fmt: skip
    assert extra == [], extra


# --- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model(), tmp_path_factory.mktemp("bad-input") / "sft")


@pytest.fixture(scope="module")
def run_uri(sft, tmp_path_factory) -> str:
    """A run with v000000 imported; the cases here fail before they could write to it."""
    config = {"prompts_per_iteration": 8, "group_size": 2, "rollout": {"num_shards": 2, "chunk_size": 2},
              "heldout_size": 0}  # fmt: skip
    return make_run(tmp_path_factory.mktemp("bad-input-run"), sft, **config)


# --- config fields (through `moerl render CONFIG --out DIR`) --------------------------------------------

BASE_CONFIG = {"sft_checkpoint": "runs/sft", "run_store": "runs/r"}

CONFIG_CASES = [
    ("not-yaml", "a: [1,\n", "not valid YAML (while parsing a flow node"),
    ("not-a-mapping", "- 1\n- 2\n", "the run config must be a YAML mapping of fields, got list"),
    ("unknown-field", {"iteratons": 3}, "iteratons: unknown field; did you mean 'iterations'?"),
    ("missing-field", {"sft_checkpoint": None}, "sft_checkpoint: required field is missing; add it"),
    ("wrong-type", {"group_size": "many"}, "group_size: Input should be a valid integer, unable to parse string"),
    ("out-of-range", {"rollout": {"num_shards": 0}}, "rollout.num_shards: Input should be greater than or equal to 1"),
    ("choice", {"staleness": 2}, "staleness: Input should be 0 or 1 (got 2)"),
    ("shards-vs-chunks", {"rollout": {"num_shards": 8, "chunk_size": 16}},
     "rollout.num_shards: 8 shards but only 4 chunks of 16 prompts per iteration; use at most 4 shards"),
    ("not-a-store-uri", {"run_store": "http://x/y"}, "run_store: 'http://x/y' is not a store URI"),
    ("unknown-task", {"task": {"name": "additon"}}, "unknown task 'additon'; use one of addition, sort, sortdesc"),
    ("argo-braces", {"name": "a{{b}}"}, "'{{' would be read by Argo as a template variable"),
    ("run-name", {"name": "My_Run"}, "name: 'My_Run' is not a valid run name"),
    ("spot-trainer", {"placement": {"trainer": {"spot": True}}},
     "placement.trainer.spot: the trainer runs on on-demand capacity"),
    ("quantity", {"placement": {"rollout": {"resources": {"limits": {"memory": "lots"}}}}},
     "placement.rollout.resources.limits.memory: 'lots' is not a Kubernetes quantity"),
    ("cron", {"schedule": {"schedules": ["* * *"]}}, "schedule.schedules.0: '* * *': has 3 fields; write 5"),
    ("timezone", {"schedule": {"timezone": "Mars/Base"}}, "unknown timezone 'Mars/Base'"),
    ("betas", {"trainer": {"betas": [0.9, 1.5]}}, "trainer.betas: [0.9, 1.5] must be two numbers in [0, 1)"),
    ("task-and-prompt-file", {"task": {"name": "addition"}, "prompt_file": "p.jsonl"},
     "both task and prompt_file are set; keep one"),
    ("reward-weight", {"rewards": {"reward_model_weight": 0.5}}, "reward_model_weight is set but no reward_model"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config(text, message, tmp_path, monkeypatch, capsys):
    if isinstance(text, dict):
        data = {**BASE_CONFIG, **text}
        text = yaml.safe_dump({k: v for k, v in data.items() if v is not None})
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert_refused(moerl(["render", str(path), "--out", str(tmp_path / "out")], monkeypatch, capsys), message)
    assert not (tmp_path / "out").exists()


def test_missing_config_file(tmp_path, monkeypatch, capsys):
    result = moerl(["render", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert_refused(result, "nope.yaml: cannot read the run config (No such file or directory); check the path")


# --- command-line flags ---------------------------------------------------------------------------------

STEP_FLAG_CASES = [
    ("rollout-iteration-0", rollout, ["--iteration", "0", "--shard", "0", "--num-shards", "2"],
     "--iteration 0: iterations count from 1"),
    ("rollout-iteration-not-int", rollout, ["--iteration", "x", "--shard", "0", "--num-shards", "2"],
     "argument --iteration: invalid int value: 'x'"),
    ("rollout-shard-out-of-range", rollout, ["--iteration", "1", "--shard", "2", "--num-shards", "2"],
     "--shard 2 --num-shards 2: need 0 <= shard < num-shards"),
    ("rollout-policy-version", rollout,
     ["--iteration", "1", "--shard", "0", "--num-shards", "2", "--policy-version", "3"],
     "--policy-version 3: iteration 1 with staleness 0 samples from v000000"),
    ("score-iteration-0", score, ["--iteration", "0"], "--iteration 0: iterations count from 1"),
    ("score-nothing-to-score", score, ["--iteration", "1"],
     "4 of 4 chunks missing: chunk 000000 (rollout shard 0 of 2)"),
    ("update-iteration-0", update, ["--iteration", "0"], "--iteration 0: iterations start at 1"),
    ("update-nothing-to-train", update, ["--iteration", "1"], "no scored experience for iteration 1; run the rollout"),
    ("publish-iteration-0", publish, ["--iteration", "0"], "--iteration 0: iterations start at 1"),
    ("publish-no-candidate", publish, ["--iteration", "1"],
     "no complete candidate (CANDIDATE.json missing); the update of iteration 1 did not finish"),
    ("publish-missing-flag", publish, [], "the following arguments are required: --iteration"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "args", "message"), [c[1:] for c in STEP_FLAG_CASES],
                         ids=[c[0] for c in STEP_FLAG_CASES])  # fmt: skip
def test_bad_step_flags(module, args, message, run_uri, monkeypatch, capsys):
    assert_refused(step(module, ["--run", run_uri, *args], monkeypatch, capsys), message)
    nothing_published(run_uri)


MOERL_FLAG_CASES = [
    ("render-without-out", ["render", "{dir}/c.yaml"], "the following arguments are required: --out"),
    ("render-bad-set", ["render", "{dir}/c.yaml", "--out", "{dir}/out", "--set", "novalue"],
     "--set 'novalue': write FIELD=VALUE, e.g. --set rollout.num_shards=3"),
    ("local-bad-chaos", ["local", "{dir}/w.yaml", "--chaos", "preempt=x"],
     "--chaos 'preempt=x': expected preempt=N[@TEMPLATE],kill=M[@TEMPLATE],seed=S with integers"),
    ("local-bad-parameter", ["local", "{dir}/w.yaml", "-p", "novalue"], "-p 'novalue': expected NAME=VALUE"),
    ("run-bad-chaos", ["run", "{dir}/c.yaml", "--workdir", "{dir}/work", "--chaos", "kill=-1"],
     "--chaos 'kill=-1': preempt and kill must be 0 or more"),
    ("unknown-command", ["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), [c[1:] for c in MOERL_FLAG_CASES], ids=[c[0] for c in MOERL_FLAG_CASES])
def test_bad_moerl_flags(args, message, tmp_path, sft, monkeypatch, capsys):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"sft_checkpoint": str(sft), "run_store": str(tmp_path / "r")}))
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(HELLO))
    assert_refused(moerl([a.format(dir=tmp_path) for a in args], monkeypatch, capsys), message)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--iterations", "0"], "iterations: Input should be greater than or equal to 1"),
     (["--chaos", "preempt=x"], "--chaos 'preempt=x': expected preempt=N[@TEMPLATE],kill=M[@TEMPLATE],seed=S")],
    ids=["iterations", "chaos"],
)  # fmt: skip
def test_moerl_demo_refuses_bad_flags_before_building_anything(args, message, tmp_path, monkeypatch, capsys):
    built = []
    monkeypatch.setattr("pipelines.sft_demo.sft_demo", lambda out, settings: built.append(out))
    result = moerl(["demo", "--workdir", str(tmp_path), *args], monkeypatch, capsys)
    assert built == [], "the SFT checkpoint was built before the flags were checked"
    assert_refused(result, message)


# --- SFT checkpoints (python -m steps.import_sft) ---------------------------------------------------------


def edit_json(name: str, **changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / name).write_text(json.dumps({**json.loads((d / name).read_text()), **changes}))

    return edit


def edit_tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    return apply


def write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data)


def truncate(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[: (d / name).stat().st_size // 2])


def pickle_only(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"never unpickled")


SFT_CASES = [
    ("config-not-json", write("config.json", b"{not json"), "config.json: not valid JSON (Expecting property name"),
    ("top-k-above-experts", edit_json("config.json", num_experts_per_tok=99),
     "num_experts_per_tok = 99 exceeds num_experts = 4; fix config.json"),
    ("weights-torn", truncate("model.safetensors"),
     "model.safetensors: not a readable safetensors file (Error while deserializing header"),
    ("weights-garbage", write("model.safetensors", b"\0" * 100), "not a readable safetensors file"),
    ("integer-weights", edit_tensors(lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].int())),
     "tensor model.norm.weight has dtype I32; moerl loads F32, BF16 or F16 weights"),
    ("unsupported-dtype", edit_json("config.json", dtype="float64", torch_dtype="float64"),
     "config.json: dtype = 'float64' is not supported; moerl trains float32, bfloat16 or float16 checkpoints"),
    ("dtype-not-the-weights", edit_json("config.json", dtype="bfloat16", torch_dtype="bfloat16"),
     "config.json: declares dtype bfloat16 but the weights are stored as float32; set dtype and torch_dtype"),
    ("mixed-dtypes", edit_tensors(lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].half())),
     "the weights are stored in several dtypes (F16: 1 tensor (e.g. model.norm.weight), F32: "),
    ("vocab-mismatch", edit_json("config.json", vocab_size=7),
     "tensor model.embed_tokens.weight has shape [52, 32], expected [7, 32] from config.json"),
    ("extra-tensor", edit_tensors(lambda t: t.__setitem__("extra.weight", torch.zeros(2))),
     "unexpected tensor extra.weight (1 unexpected in all) for a Qwen3-MoE model"),
    ("tokenizer-garbage", write("tokenizer.json", b"{}"), "tokenizer.json is not a valid tokenizer file"),
    ("pickle-only", pickle_only, "weights are pickled (pytorch_model.bin); moerl reads safetensors only"),
]  # fmt: skip


def broken_sft(sft: Path, tmp_path: Path, breakage: Callable[[Path], None]) -> Path:
    src = tmp_path / "sft"
    src.mkdir()
    for path in sft.iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    breakage(src)
    return src


@pytest.mark.parametrize(("breakage", "message"), [c[1:] for c in SFT_CASES], ids=[c[0] for c in SFT_CASES])
def test_bad_sft_checkpoint(breakage, message, sft, tmp_path, monkeypatch, capsys):
    src = broken_sft(sft, tmp_path, breakage)
    result = step(import_sft, ["--src", str(src), "--run", str(tmp_path / "run")], monkeypatch, capsys)
    assert_refused(result, message)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("where", ["empty", "missing"])
def test_no_sft_checkpoint_there(where, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    result = step(import_sft, ["--src", str(tmp_path / where), "--run", str(tmp_path / "run")], monkeypatch, capsys)
    assert_refused(result, f"{(tmp_path / where).as_uri()}: no files there; point --src at an HF-format checkpoint")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_bad_sft_checkpoint_is_named_by_its_source_uri(sft, tmp_path, monkeypatch, capsys):
    src = broken_sft(sft, tmp_path, write("config.json", b"{not json"))
    result = step(import_sft, ["--src", str(src), "--run", str(tmp_path / "run")], monkeypatch, capsys)
    assert_refused(result, f"{src.as_uri()}/config.json: not valid JSON")


def test_an_sft_checkpoint_with_nan_weights_is_refused(sft, tmp_path, monkeypatch, capsys):
    def nan(tensors: dict) -> None:
        tensors["model.norm.weight"][0] = float("nan")

    src = broken_sft(sft, tmp_path, edit_tensors(nan))
    result = step(import_sft, ["--src", str(src), "--run", str(tmp_path / "run")], monkeypatch, capsys)
    assert_refused(result, f"{src.as_uri()}/model.safetensors: tensor model.norm.weight holds NaN or inf values")
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- prompt files (read by rollout from run.json's prompt_file; moerl check reads them before, test_check.py) --

GOOD_PROMPT = '{"prompt_id": "a", "prompt": "1+2=", "answer": "3", "task": "addition"}\n'

PROMPT_CASES = [
    ("not-json", GOOD_PROMPT + "{oops\n", "line 2: invalid JSON (Expecting property name enclosed in double quotes"),
    ("not-an-object", "[1, 2]\n", "line 1: not a JSON object (got list)"),
    ("missing-field", '{"prompt_id": "a", "prompt": "1+2=", "task": "addition"}\n', "line 1: missing field 'answer'"),
    ("duplicate-id", GOOD_PROMPT * 2, "line 2: duplicate prompt_id 'a', first on line 1"),
    ("null-answer", GOOD_PROMPT.replace('"3"', "null"), "field 'answer' must be a string or a number, got null"),
    ("no-prompt-field", '{"answer": "3"}\n', "line 1: missing field 'prompt' (the prompt)"),
    ("outside-vocabulary", GOOD_PROMPT.replace("1+2=", "héllo"),
     "prompt 'a': the checkpoint's tokenizer cannot encode 'é' (it maps them to its unknown token)"),
    ("empty", "", "has no prompts; each record needs \"prompt\""),
    ("not-utf8", GOOD_PROMPT.encode().replace(b"1+2=", b"\xe9"), "is not UTF-8 text (bad byte at offset 30)"),
    ("missing", None, "does not exist; upload the JSONL or Parquet file there or fix the URI"),
]  # fmt: skip


@pytest.mark.parametrize(("content", "message"), [c[1:] for c in PROMPT_CASES], ids=[c[0] for c in PROMPT_CASES])
def test_bad_prompt_file(content, message, sft, tmp_path, monkeypatch, capsys):
    prompt_file = tmp_path / "prompts.jsonl"
    if content is not None:
        prompt_file.write_bytes(content if isinstance(content, bytes) else content.encode())
    run = make_run(tmp_path, sft, prompt_file=prompt_file.as_uri(), prompts_per_iteration=4, group_size=2,
                   rollout={"num_shards": 1, "chunk_size": 2}, heldout_size=0)  # fmt: skip
    result = step(rollout, ["--run", run, "--iteration", "1", "--shard", "0", "--num-shards", "1"], monkeypatch, capsys)
    # a bad record names the file; a prompt the checkpoint's tokenizer cannot encode names the prompt
    names = "prompt 'a': " if message.startswith("prompt 'a'") else f"prompt file {prompt_file.as_uri()} "
    assert_refused(result, names)
    assert message in result[1]
    nothing_published(run)


# --- experience files (rollout chunks read by score, scored experience read by update) --------------------


def chunk_edit(edit: Callable[[pa.Table], pa.Table]) -> Callable[[Store], None]:
    """Rewrite rollout chunk 1 (keeping its plan metadata, so only the edit is wrong)."""

    def apply(run: Store) -> None:
        table = read_table(run, chunk_key(1, 1))
        run.put_bytes(chunk_key(1, 1), table_bytes(edit(table).replace_schema_metadata(table.schema.metadata)))

    return apply


def nan_logprobs(table: pa.Table) -> pa.Table:
    i = table.schema.get_field_index("behavior_logprobs")
    values = [[float("nan")] * len(r) for r in table.column("response_ids").to_pylist()]
    return table.set_column(i, table.schema.field(i), pa.array(values, pa.list_(pa.float32())))


def int_answers(table: pa.Table) -> pa.Table:
    i = table.schema.get_field_index("answer")
    return table.set_column(i, pa.field("answer", pa.int64()), pa.array([1] * table.num_rows, pa.int64()))


SCORE_CASES = [
    pytest.param(lambda run: run.put_bytes(chunk_key(1, 1), b"not parquet"),
                 "chunk-000001.parquet: not a readable Parquet file (", id="chunk-not-parquet"),
    pytest.param(lambda run: run.delete(chunk_key(1, 1)),
                 "1 of 2 chunks missing: chunk 000001 (rollout shard 1 of 2)", id="chunk-missing"),
    pytest.param(chunk_edit(lambda t: t.drop_columns(["response_ids"])),
                 "chunk-000001.parquet: ", id="chunk-without-a-column"),
    pytest.param(chunk_edit(lambda t: t.drop_columns(["prompt_id"])),
                 "chunk-000001.parquet: ", id="chunk-without-prompt-id"),
    pytest.param(chunk_edit(int_answers), "chunk-000001.parquet: ", id="chunk-column-of-another-type"),
    pytest.param(chunk_edit(nan_logprobs), "chunk-000001.parquet: ", id="chunk-nan-logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(("breakage", "message"), SCORE_CASES)
def test_bad_rollout_chunk(breakage, message, sft, tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, sft, **SCORE_CONFIG)
    write_hand_made_rollout(run)
    breakage(Store.open(run))
    result = step(score, ["--run", run, "--iteration", "1", "--metrics-out", str(tmp_path / "m.json")],
                  monkeypatch, capsys)  # fmt: skip
    assert_refused(result, message)
    assert not Store.open(run).exists(scored_key(1)) and not (tmp_path / "m.json").exists()


def scored_column(name: str, values: list) -> pa.Table:
    table = experience_table(0)
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


ROWS = 16
UPDATE_CASES = [
    pytest.param(b"garbage", "scored.parquet: not a readable Parquet file (", id="not-parquet"),
    pytest.param(experience_table(0).drop_columns(["advantage"]), "scored.parquet: missing columns ['advantage']",
                 id="missing-column"),
    pytest.param(scored_column("advantage", [float("nan")] + [0.0] * (ROWS - 1)),
                 "row 0 (prompt_id 'p000', sample_index 0): reward, advantage or behavior_logprobs is NaN/inf/null",
                 id="nan-advantage"),
    pytest.param(experience_table(3), "experience from policy version(s) [3], but iteration 1 trains on samples "
                 "of v000000", id="other-policy-version"),
    pytest.param(experience_table(0).slice(0, 0), "no rows; iteration 1 produced no experience", id="no-rows"),
    pytest.param(scored_column("behavior_logprobs", [[-1.0]] * ROWS), "behavior_logprobs; the rollout must record "
                 "one log-prob per response token", id="logprobs-per-token"),
    pytest.param(scored_column("response_ids", [[999999]] * ROWS).set_column(
                     4, "behavior_logprobs", pa.array([[-1.0]] * ROWS, pa.list_(pa.float32()))),
                 "scored.parquet: prompt_id 'p000' sample 0 holds token id 999999 outside the policy's vocabulary",
                 id="token-outside-vocabulary"),
]  # fmt: skip


@pytest.mark.parametrize(("scored", "message"), UPDATE_CASES)
def test_bad_scored_experience(scored, message, sft, tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, sft, **SCORE_CONFIG)
    if isinstance(scored, bytes):
        Store.open(run).put_bytes(scored_key(1), scored)
    else:
        write_experience(run, 1, scored)
    assert_refused(step(update, ["--run", run, "--iteration", "1"], monkeypatch, capsys), message)
    assert not Store.open(run).list("candidates/")


# --- store URIs -----------------------------------------------------------------------------------------

ACCEPTED = "accepted forms: a local path (runs/r1 or /abs/runs/r1), file:///abs/runs/r1, or s3://bucket[/prefix]"
URI_CASES = [
    ("s3://Bad_Bucket/x", "bucket name 'Bad_Bucket' has upper-case letters (S3 bucket names are lower case)"),
    ("s3:/bucket/x", "is missing the '//' after the scheme"),
    ("gs://bucket/x", "scheme 'gs' is not supported"),
    ("s3a://bucket/x", "scheme 's3a' is not supported (use s3:// for S3)"),
    ("s3://bucket/a/../b", "has a bad prefix (store prefix 'a/../b' has a '..' segment"),
    ("s3://bucket/x?versionId=1", "has a query or fragment; name the bucket and prefix only"),
    ("s3://192.168.1.1/x", "bucket name '192.168.1.1' is not valid (no '..', not an IP address)"),
    ("s3://", "names no bucket"),
    ("file://", "names no path"),
    ("", "is empty"),
]


@pytest.mark.parametrize(("uri", "message"), URI_CASES, ids=[c[0] or "empty" for c in URI_CASES])
def test_bad_store_uri(uri, message, sft, tmp_path, monkeypatch, capsys):
    result = step(import_sft, ["--src", str(sft), "--run", uri], monkeypatch, capsys)
    assert_refused(result, f"store URI {uri!r}: {message}")
    assert ACCEPTED in result[1]


def test_a_run_store_that_holds_no_run(tmp_path, monkeypatch, capsys):
    args = ["--run", str(tmp_path / "none"), "--iteration", "1", "--shard", "0", "--num-shards", "2"]
    assert_refused(step(rollout, args, monkeypatch, capsys), "run.json: no run config; the run has not been imported")
    assert not (tmp_path / "none").exists()


# --- credentials (S3 with moto's IAM checks on) ------------------------------------------------------------

SECRET = "moerl-wrong-secret-7d1c"


@pytest.mark.parametrize(
    ("credentials", "message"),
    [
        ("unknown-key", "access denied (InvalidAccessKeyId: "),
        ("wrong-secret", "access denied (SignatureDoesNotMatch: the secret key does not match the access key id) — "
                         "check AWS_SECRET_ACCESS_KEY"),
        ("read-only", "access denied (AccessDenied) — the credentials in use may not read/write s3://"),
        ("none", "no usable AWS credentials (Unable to locate credentials) — set AWS_ACCESS_KEY_ID"),
        ("unknown-profile", "The config profile (no-such-profile) could not be found — set AWS_PROFILE to a profile"),
        ("no-bucket", "bucket 'moerl-no-such-bucket' does not exist (NoSuchBucket)"),
    ],
)  # fmt: skip
def test_bad_credentials(credentials, message, s3_env, sft, monkeypatch, capsys):
    bucket = s3_env.create_bucket()
    if credentials in ("wrong-secret", "read-only"):
        key_id, secret = s3_env.create_access_key(allow=["s3:ListBucket", "s3:GetObject"])
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET if credentials == "wrong-secret" else secret)
    elif credentials == "unknown-key":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    elif credentials == "none":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    elif credentials == "unknown-profile":
        monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    elif credentials == "no-bucket":
        bucket = "moerl-no-such-bucket"
    checks = s3_env.iam_auth() if credentials in ("unknown-key", "wrong-secret", "read-only") else nullcontext()
    with checks:
        result = step(import_sft, ["--src", str(sft), "--run", f"s3://{bucket}/run"], monkeypatch, capsys)
    assert_refused(result, f"error: s3://{bucket}/run")
    assert message in result[1]
    assert SECRET not in result[1]  # a secret is never echoed
    if credentials != "no-bucket":
        assert s3_env.s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


# --- manifests handed to `moerl local` -----------------------------------------------------------------------

HELLO = {
    "apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "t"},
    "spec": {"entrypoint": "main", "templates": [{"name": "main", "container": {"image": "busybox",
                                                                                 "command": ["echo", "hi"]}}]},
}  # fmt: skip


def hello(**spec) -> dict:
    manifest = copy.deepcopy(HELLO)
    manifest["spec"].update(spec)
    return manifest


TWO_STEPS = [{"name": "main", "steps": [[{"name": "a", "template": "w", "when": "{{=1 +}}"}]]},
             {"name": "w", "container": {"image": "x", "command": ["true"]}}]  # fmt: skip
MANIFEST_CASES = [
    ("not-yaml", "kind: [\n", "is not valid YAML: while parsing a flow node"),
    ("empty", "", "no Argo workflow in it (kinds found: none); give a manifest with kind Workflow"),
    ("not-a-workflow", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}},
     "no Argo workflow in it (kinds found: Pod)"),
    ("no-entrypoint", hello(entrypoint=None), "spec.entrypoint is required; name the template to start with"),
    ("unknown-entrypoint", hello(entrypoint="nope"), "spec.entrypoint: template name 'nope' undefined"),
    ("unknown-template", hello(templates=[{"name": "main", "steps": [[{"name": "a", "template": "missing"}]]}]),
     "spec.templates[0] ('main').steps[0][0] ('a'): template name 'missing' undefined"),
    ("bad-expression", hello(templates=TWO_STEPS), "spec.templates[0] ('main').steps[0][0].when: unexpected"),
    ("unsupported-field", hello(templates=[{**HELLO["spec"]["templates"][0], "sidecars": [{"name": "s"}]}]),
     "unsupported: sidecars at spec.templates[0] ('main')"),
    ("typo", hello(templates=[{**HELLO["spec"]["templates"][0], "retryStrategy": {"limt": 3}}]),
     "unknown field: limt at spec.templates[0].retryStrategy"),
]  # fmt: skip


@pytest.mark.parametrize(("manifest", "message"), [c[1:] for c in MANIFEST_CASES],
                         ids=[c[0] for c in MANIFEST_CASES])  # fmt: skip
def test_bad_manifest(manifest, message, tmp_path, monkeypatch, capsys):
    path = tmp_path / "workflow.yaml"
    path.write_text(manifest if isinstance(manifest, str) else yaml.safe_dump(manifest))
    result = moerl(["local", str(path), "--workdir", str(tmp_path / "work")], monkeypatch, capsys)
    assert_refused(result, message)
    assert not (tmp_path / "work").exists()  # nothing ran


def test_a_parameter_the_manifest_does_not_declare(tmp_path, monkeypatch, capsys):
    path = tmp_path / "workflow.yaml"
    path.write_text(yaml.safe_dump(HELLO))
    result = moerl(["local", str(path), "-p", "zzz=1", "--workdir", str(tmp_path / "work")], monkeypatch, capsys)
    assert_refused(result, "-p zzz: the workflow declares no parameter 'zzz' (declared: none); check the spelling")


def test_a_directory_given_as_manifest(tmp_path, monkeypatch, capsys):
    assert_refused(moerl(["local", str(tmp_path)], monkeypatch, capsys), f"manifest {tmp_path} is a directory")
