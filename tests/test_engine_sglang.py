"""How the SGLang engine talks to SGLang: the per-request sampling_params it sends and how it reads SGLang's
output dicts back. These run everywhere; generation itself is in test_engine_contract.py (GPU only)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from steps.engines.interface import FINISH_LENGTH, FINISH_STOP, GenerationRequest, SamplingParams
from steps.engines.sglang_engine import (
    SGLANG_SEED_MODULUS,
    RoutesLayout,
    SGLangEngine,
    SGLangSettings,
    checkpoint_dtype,
    generation_from_output,
    sampling_params_for,
    sglang_unavailable_reason,
)
from steps.errors import MoerlError

REQUEST = GenerationRequest("addition3/012345", (1, 5, 6), 3, seed=2**63 + 5)


def test_sampling_params_carry_the_seed_and_keep_the_stop_token():
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=0, max_new_tokens=12, stop_token_ids=(2,), n=8)
    sent = sampling_params_for(REQUEST, params)
    assert sent == {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": -1,  # SGLang's "off"
        "max_new_tokens": 12,
        "stop_token_ids": [2],
        "ignore_eos": False,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "sampling_seed": 5,  # reduced into SGLang's signed 64-bit range
    }
    assert 0 <= sent["sampling_seed"] < SGLANG_SEED_MODULUS
    no_stop = sampling_params_for(REQUEST, SamplingParams(top_k=4, stop_token_ids=()))
    assert no_stop["ignore_eos"] is True and no_stop["stop_token_ids"] == [] and no_stop["top_k"] == 4


def test_outputs_become_generations_with_one_logprob_per_token():
    output = {
        "output_ids": [7, 8, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [(-0.5, 7, None), (-1.25, 8, None), (-0.125, 2, None)],
        },
    }
    g = generation_from_output(REQUEST, output)
    assert (g.prompt_id, g.sample_index, g.response_ids, g.logprobs, g.finish_reason) == (
        "addition3/012345", 3, [7, 8, 2], [-0.5, -1.25, -0.125], FINISH_STOP,
    )  # fmt: skip
    output["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    assert generation_from_output(REQUEST, output).finish_reason == FINISH_LENGTH


def test_aborted_or_inconsistent_outputs_are_clear_errors():
    aborted = {"meta_info": {"finish_reason": {"type": "abort", "message": "oom"}, "output_token_logprobs": []}}
    with pytest.raises(MoerlError, match="SGLang did not finish prompt addition3/012345 sample 3"):
        generation_from_output(REQUEST, aborted)
    mismatched = {
        "output_ids": [7, 8],
        "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.5, 7, None)]},
    }
    with pytest.raises(MoerlError, match="2 output ids but 1 token log-probs"):
        generation_from_output(REQUEST, mismatched)


def test_without_sglang_or_a_gpu_the_engine_says_why():
    reason = sglang_unavailable_reason()
    if reason is None:
        pytest.skip("SGLang and a CUDA GPU are present: the engine runs in test_engine_contract.py")
    assert reason.startswith(("SGLang not installed", "no CUDA GPU"))
    with pytest.raises(MoerlError, match="rollout.engine 'sglang': .*set rollout.engine: torch"):
        SGLangEngine("/nonexistent", SGLangSettings())


FAKE_SGLANG = Path(__file__).parent / "fake_sglang"
ROLLOUT_WITH_SGLANG = """
import sys
sys.path.insert(0, sys.argv[1])
import steps.engines.sglang_engine as se
from steps.engines.interface import GenerationRequest, SamplingParams
from steps.engines.sglang_engine import SGLangSettings
from steps.experience.rollout_chunks import EXIT_PREEMPTED, Preempted, Preemption
se.sglang_unavailable_reason = lambda: None  # the fake needs no GPU
preemption = Preemption()
preemption.install()  # as steps.rollout's main does, before the engine starts
engine = se.SGLangEngine(sys.argv[2], SGLangSettings())
request = GenerationRequest("p", (1, 2), 0, seed=1)
try:
    print(engine.generate([request], SamplingParams(stop_token_ids=(2,))))
except Preempted:
    sys.exit(EXIT_PREEMPTED)
"""


def run_rollout_with_fake_sglang(tmp_path, config: dict, sigterm: bool) -> tuple[subprocess.CompletedProcess, dict]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    record = tmp_path / "engine-kwargs.json"
    env = {**os.environ, "FAKE_SGLANG_RECORD": str(record), "PYTHONPATH": str(Path(__file__).parents[1])}
    if sigterm:
        env["FAKE_SGLANG_SIGTERM_DURING_GENERATE"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", ROLLOUT_WITH_SGLANG, str(FAKE_SGLANG), str(model)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, (json.loads(record.read_text()) if record.exists() else {})


def test_a_sigterm_during_sglang_generation_ends_the_step_with_143(tmp_path):
    """SGLang's own SIGTERM handler would drain and SIGKILL the process (exit 137, -9 to subprocess)."""
    done, _ = run_rollout_with_fake_sglang(tmp_path, {"dtype": "bfloat16"}, sigterm=True)
    assert done.returncode == 143, (done.returncode, done.stderr[-2000:])
    done, _ = run_rollout_with_fake_sglang(tmp_path, {"dtype": "bfloat16"}, sigterm=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(
    "config,dtype",
    [({"dtype": "float32"}, "float32"), ({"torch_dtype": "bfloat16"}, "bfloat16"), ({}, "float32"),
     ({"dtype": "float16"}, "float16")],
)  # fmt: skip
def test_sglang_serves_the_checkpoints_own_dtype_never_auto(tmp_path, config, dtype):
    """`auto` would serve a float32 checkpoint in float16 (sglang model_config._get_and_verify_dtype)."""
    assert checkpoint_dtype_of(tmp_path, config) == dtype


def test_the_engine_passes_the_dtype_to_sglang(tmp_path):
    done, kwargs = run_rollout_with_fake_sglang(tmp_path, {"dtype": "float32"}, sigterm=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert kwargs["dtype"] == "float32"


def checkpoint_dtype_of(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return checkpoint_dtype(tmp_path)


def test_a_dtype_sglang_cannot_serve_is_a_clear_error(tmp_path):
    with pytest.raises(MoerlError, match=r"config.json: dtype 'int8' is not one SGLang serves; publish"):
        checkpoint_dtype_of(tmp_path, {"dtype": "int8"})


UPDATE_WITH_SGLANG = """
import json, sys
sys.path.insert(0, sys.argv[1])
import steps.engines.sglang_engine as se
from steps.errors import MoerlError
from steps.engines.interface import GenerationRequest, SamplingParams
se.sglang_unavailable_reason = lambda: None  # the fake needs no GPU
engine = se.SGLangEngine(sys.argv[2], se.SGLangSettings())
said = {}
for label, model_dir in json.loads(sys.argv[3]).items():
    try:
        engine.update_weights(model_dir)
        said[label] = "ok"
    except MoerlError as err:
        said[label] = str(err)
said["updates"] = engine.engine.updates
try:
    engine.generate([GenerationRequest("p", (1, 2), 0, seed=1)], SamplingParams(stop_token_ids=(2,)))
    said["generate"] = "ok"
except MoerlError as err:
    said["generate"] = str(err)
print(json.dumps(said))
"""


def update_with_fake_sglang(start: Path, updates: dict[str, Path]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    paths = json.dumps({label: str(path) for label, path in updates.items()})
    done = subprocess.run(
        [sys.executable, "-c", UPDATE_WITH_SGLANG, str(FAKE_SGLANG), str(start), paths],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_an_in_place_update_calls_update_weights_from_disk_and_a_failure_stops_the_engine(tmp_path):
    """SGLang 0.5.17: Engine.update_weights_from_disk(model_path, load_format=None) -> (success, message,
    num_paused_requests); the fake holds its signature and failure rules (tests/fake_sglang)."""
    import shutil

    import torch
    from delta_helpers import moved
    from experience_helpers import tiny_model, write_checkpoint

    model = tiny_model(seed=3).to(torch.bfloat16)
    v0 = write_checkpoint(model, tmp_path / "v0")
    v1 = write_checkpoint(moved(model, seed=1), tmp_path / "v1")
    other_dtype = write_checkpoint(moved(model, seed=1).float(), tmp_path / "fp32")
    other_model = write_checkpoint(tiny_model(seed=3, num_experts=8).to(torch.bfloat16), tmp_path / "experts8")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(v1 / "config.json", no_weights / "config.json")
    misfit = write_checkpoint(moved(model, seed=2), tmp_path / "misfit")
    with open(misfit / "config.json") as f:  # same config.json, weights of a wider expert: SGLang's load fails
        config = json.load(f)
    write_checkpoint(tiny_model(seed=3, moe_intermediate_size=24).to(torch.bfloat16), misfit)
    (misfit / "config.json").write_text(json.dumps(config))

    said = update_with_fake_sglang(
        v0, {"v1": v1, "fp32": other_dtype, "experts8": other_model, "no_weights": no_weights}
    )
    assert said["v1"] == "ok" and said["updates"] == [str(v1)]
    for label in ("fp32", "experts8"):  # refused before SGLang sees them: it would not read config.json again
        assert "another model or dtype than this SGLang engine serves" in said[label]
    assert "Failed to get weights iterator" in said["no_weights"]
    assert said["generate"].startswith("SGLang could not load") and "no version's" in said["generate"]

    said = update_with_fake_sglang(v0, {"misfit": misfit, "v1": v1})
    assert "Failed to update weights" in said["misfit"] and "Rolling back" in said["misfit"]
    assert said["v1"] == "ok" and said["generate"] == "ok"  # a successful update makes it whole again


# --- Routed experts (rollout.record_routes; SGLang 0.5.17, held by tests/fake_sglang) ---

ROUTES_LAYOUT = RoutesLayout(num_layers=3, top_k=2, moe_layers=(0, 2))


def encoded_routes(routes) -> str:
    """As SGLang's detokenizer writes meta_info["routed_experts"]: base64 of the int32 array's C-order bytes."""
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(routes, dtype=np.int32).tobytes()).decode()


def test_routed_experts_become_the_moe_layers_routes_of_every_token_but_the_last():
    import numpy as np

    positions = len(REQUEST.prompt_ids) + 3 - 1
    every = np.zeros((positions, 3, 2), dtype=np.int32)  # the dense layer 1 never written: zeros
    every[:, 0] = [[1, 3]] * positions
    every[:, 2] = [[0, 2]] * positions
    output = {
        "output_ids": [7, 8, 2],
        "meta_info": {"finish_reason": {"type": "stop"}, "routed_experts": encoded_routes(every),
                      "output_token_logprobs": [(-0.5, 7, None), (-1.25, 8, None), (-0.125, 2, None)]},
    }  # fmt: skip
    g = generation_from_output(REQUEST, output, ROUTES_LAYOUT)
    assert g.routed_experts.dtype == np.int16 and g.routed_experts.shape == (positions, 2, 2)
    assert (g.routed_experts == every[:, [0, 2]]).all()
    assert generation_from_output(REQUEST, output).routed_experts is None  # not asked for: not read
    with pytest.raises(MoerlError, match=r"returned 30 routed-expert ids, not 4 tokens x 3 layers x top-2"):
        generation_from_output(REQUEST, {**output, "output_ids": [7, 8], "meta_info": {
            **output["meta_info"], "output_token_logprobs": output["meta_info"]["output_token_logprobs"][:2]}},
            ROUTES_LAYOUT)  # fmt: skip
    unwritten = every.copy()
    unwritten[:, 2] = 0  # an MoE runner that bypasses the capturer leaves zeros: an expert chosen twice
    with pytest.raises(MoerlError, match="layer 2 repeat an expert in a top-2: it recorded no routes there"):
        generation_from_output(REQUEST, {**output, "meta_info": {**output["meta_info"],
                                                                 "routed_experts": encoded_routes(unwritten)}},
                               ROUTES_LAYOUT)  # fmt: skip
    without = {**output, "meta_info": {k: v for k, v in output["meta_info"].items() if k != "routed_experts"}}
    with pytest.raises(MoerlError, match="returned no routed experts; the engine must start with enable_return"):
        generation_from_output(REQUEST, without, ROUTES_LAYOUT)


ROUTES_WITH_SGLANG = """
import json, sys
sys.path.insert(0, sys.argv[1])
import steps.engines.sglang_engine as se
from steps.engines.interface import GenerationRequest, SamplingParams
se.sglang_unavailable_reason = lambda: None  # the fake needs no GPU
engine = se.SGLangEngine(sys.argv[2], se.SGLangSettings(record_routes=sys.argv[3] == "record"))
(g,) = engine.generate([GenerationRequest("p", (5, 6, 7, 8), 0, seed=1)], SamplingParams(stop_token_ids=(2,)))
print(json.dumps(None if g.routed_experts is None else g.routed_experts.tolist()))
"""


@pytest.mark.parametrize("record", ["record", "off"])
def test_the_engine_asks_sglang_for_the_routes_only_when_recording(tmp_path, record):
    from experience_helpers import tiny_model, write_checkpoint

    model = tiny_model(num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=24)  # layer 1 dense
    checkpoint = write_checkpoint(model, tmp_path / "model")
    kwargs_file = tmp_path / "engine-kwargs.json"
    env = {**os.environ, "FAKE_SGLANG_RECORD": str(kwargs_file), "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", ROUTES_WITH_SGLANG, str(FAKE_SGLANG), str(checkpoint), record],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    routes = json.loads(done.stdout.splitlines()[-1])
    kwargs = json.loads(kwargs_file.read_text())
    if record == "off":
        assert routes is None and "enable_return_routed_experts" not in kwargs
        return
    assert kwargs["enable_return_routed_experts"] is True
    # The fake's ids (tests/fake_sglang): (position * 7 + layer + 3 * j) mod 4, for the MoE layers 0 and 2 only
    expected = [[[(p * 7 + layer + 3 * j) % 4 for j in range(2)] for layer in (0, 2)] for p in range(4)]
    assert routes == expected  # 4 prompt tokens + 1 response token - 1
