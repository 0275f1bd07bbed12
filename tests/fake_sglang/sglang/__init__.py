"""A stand-in for the `sglang` package (0.5.17) with what steps/engines/sglang_engine.py relies on, on CPU:

- Engine(**kwargs) accepts only ServerArgs' field names that moerl passes (and records them to the JSON file
  named by $FAKE_SGLANG_RECORD), with `dtype` and `moe_runner_backend` among ServerArgs' choices,
  `disable_radix_cache` a bool (ServerArgs' type), and an
  `attention_backend` under enable_deterministic_inference among DETERMINISTIC_ATTENTION_BACKEND_CHOICES
  (a ValueError otherwise, as _deterministic_attention_backend raises), and takes $FAKE_SGLANG_START_S
  seconds to start (default 0: SGLang's takes minutes on a large model); its last act is to make a new
  asyncio loop the thread's current one, `Engine.loop` (entrypoints/engine.py Engine.__init__), on which
  generate and update_weights_from_disk then run (`self.loop.run_until_complete(...)`);
- the engine's tokenizer_manager creates its request loop once (TokenizerManager.auto_create_handle_loop,
  called by generate_request): on `get_or_create_event_loop()` (srt/utils/common.py: the running loop, else
  a NEW loop made current), where it starts handle_loop, the only reader of the scheduler's outputs, and
  registers SIGTERM. Called outside a running loop it therefore lands on another loop than Engine.loop, and
  every later generate or update waits for outputs that no one reads: SGLang hangs there, the fake raises.
  SGLang's SIGTERM handler drains the requests and then SIGKILLs its own process tree, the engine's process
  included (sigterm_watchdog -> kill_process_tree(os.getpid(), include_parent=True) -> psutil kill): exit 137;
- generate(prompt=None, sampling_params=None, input_ids=None, ..., return_logprob=False) runs the loop until
  its outputs are ready, $FAKE_SGLANG_GENERATE_S seconds (default 0.05; $FAKE_SGLANG_GENERATING names a
  file written when a batch starts); with $FAKE_SGLANG_SIGTERM_DURING_GENERATE set, the process receives
  SIGTERM while it runs;
- TokenizerManager.abort_request(rid="", abort_all=False) (managers/tokenizer_manager.py): an empty rid
  without abort_all is ignored; abort_all (or a rid prefix, the scheduler's `startswith`) aborts the requests
  in flight, which then finish, and generate returns them, with meta_info.finish_reason {"type": "abort",
  "message": ..., "status_code": None} (Scheduler.abort_request: FINISH_ABORT() for a running request, an
  AbortReq echo for a waiting one, which _handle_abort_req turns into the same; with no status_code,
  _handle_abort_finish_reason raises nothing);
- update_weights_from_disk(model_path, load_format=None) (Engine, entrypoints/engine.py) returns
  TokenizerManager.update_weights_from_disk's (success, message, num_paused_requests), with the failures of
  ModelRunner's weight updater (model_runner_components/weight_updater.py update_weights_from_disk): no
  safetensors at model_path -> "Failed to get weights iterator: ..."; a tensor the running model does not
  have, or of another shape, or a load that raises (the first $FAKE_SGLANG_UPDATE_FAILS loads of the process
  fail so, as a CUDA OOM in load_weights_and_postprocess would) -> "Failed to update weights: ...\nRolling
  back to original weights." (its model_path already points at the new dir); a tensor the dir lacks is no
  error (the old one stays). The running model is the safetensors headers of the model_path it started
  with. config.json is never read again;
- routed experts: Engine(enable_return_routed_experts=True) (ServerArgs, default False, checked against nothing)
  and generate(..., return_routed_experts=False) (one flag for the whole batch: GenerateReqInput.__getitem__
  copies it to every request): a finished request's meta_info["routed_experts"] is
  base64(int32 C-order bytes) of [len(input_ids) + completion_tokens - 1, num_hidden_layers, num_experts_per_tok]
  (state_capturer/base.py get_topk: positions [0, seqlen - 1); detokenizer_manager.py pybase64.b64encode of
  .numpy().tobytes()), logical expert ids, every decoder layer a row, the rows of dense layers (DeepSeek-V3's
  first first_k_dense_replace, a Qwen3 layer in mlp_only_layers) zeros, never written. Without the server
  argument a request asking for them gets no such key and no error (batch_result_processor.py
  _maybe_collect_routed_experts returns when there is no capturer). The fake's ids: (position * 7 + layer +
  3 * j) mod num_experts for choice j, distinct within a row; $FAKE_SGLANG_ROUTES_UNWRITTEN names a layer whose
  rows stay zeros (an MoE runner that bypasses the capturer);
- shutdown() ends the engine; nothing runs on it afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__version__ = "0.5.17"
SERVER_ARGS = {
    "model_path",
    "dtype",
    "skip_tokenizer_init",
    "tp_size",
    "ep_size",
    "mem_fraction_static",
    "enable_deterministic_inference",
    "random_seed",
    "log_level",
    "moe_a2a_backend",
    "deepep_mode",
    "attention_backend",
    "moe_runner_backend",
    "enable_return_routed_experts",
    "disable_radix_cache",  # srt/server_args.py:923, bool, default False (Qwen3-Next: family_server_args)
}
DTYPE_CHOICES = {"auto", "half", "float16", "bfloat16", "float", "float32"}
# srt/server_args.py:220 DETERMINISTIC_ATTENTION_BACKEND_CHOICES: an attention_backend set outside it with
# enable_deterministic_inference is a ValueError (arg_groups/overrides.py _deterministic_attention_backend).
DETERMINISTIC_ATTENTION_BACKEND_CHOICES = {"ascend", "fa3", "fa4", "flashinfer", "triton"}
MOE_RUNNER_BACKEND_CHOICES = {"auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm",
                              "experimental_sgl_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutlass",
                              "flashinfer_mxfp4", "flashinfer_cutedsl", "cutlass", "aiter", "marlin", "humming",
                              "experimental_sgl_marlin", "hpc_ops"}  # fmt: skip  # server_args.py:248
STEP_S = 0.05  # one "decode step" of the fake


def _failing_loads() -> list[int]:
    """How many more loads of this process fail (a process-wide count: a reopened engine is a new Engine)."""
    global _FAILING_LOADS
    if _FAILING_LOADS is None:
        _FAILING_LOADS = [int(os.environ.get("FAKE_SGLANG_UPDATE_FAILS") or 0)]
    return _FAILING_LOADS


_FAILING_LOADS: list[int] | None = None


def get_or_create_event_loop() -> asyncio.AbstractEventLoop:
    """srt/utils/common.py get_or_create_event_loop: the running loop, else a new one made current."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


@dataclass
class ReqState:
    abort_requested: bool = False


class TokenizerManager:
    def __init__(self) -> None:
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.gracefully_exit = False
        self.rid_to_state: dict[str, ReqState] = {}
        self.aborts: list[tuple[str, bool]] = []  # every abort_request(rid, abort_all) that reached it

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        loop = get_or_create_event_loop()
        self.event_loop = loop  # handle_loop and sigterm_watchdog are tasks of this loop
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self.sigterm_handler)

    def sigterm_handler(self) -> None:
        self.gracefully_exit = True
        self.event_loop.call_soon(os.kill, os.getpid(), signal.SIGKILL)  # after draining: kill_process_tree

    def _outputs_arrive(self) -> None:
        """handle_loop, the reader of the scheduler's outputs, runs on self.event_loop only."""
        if asyncio.get_running_loop() is not self.event_loop:
            raise AssertionError(
                "awaiting SGLang outputs on another event loop than the one handle_loop runs on "
                "(TokenizerManager.auto_create_handle_loop was called outside Engine.loop): SGLang hangs here"
            )

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and not rid:
            return  # upstream: "Ignore abort_request with empty rid and abort_all=False"
        self.aborts.append((rid, abort_all))
        for state_rid, state in self.rid_to_state.items():
            if abort_all or state_rid.startswith(rid):
                state.abort_requested = True

    async def generate_request(
        self, input_ids: list, return_logprob: bool, routes: RoutesModel | None = None
    ) -> list[dict]:
        self.auto_create_handle_loop()
        self._outputs_arrive()
        rids = [uuid.uuid4().hex for _ in input_ids]
        self.rid_to_state.update({rid: ReqState() for rid in rids})  # _init_req_state, before any await
        try:
            sigterm = bool(os.environ.get("FAKE_SGLANG_SIGTERM_DURING_GENERATE"))
            if os.environ.get("FAKE_SGLANG_GENERATING"):
                Path(os.environ["FAKE_SGLANG_GENERATING"]).write_text(str(os.getpid()))
            if sigterm:
                os.kill(os.getpid(), signal.SIGTERM)
            seconds = 10.0 if sigterm else float(os.environ.get("FAKE_SGLANG_GENERATE_S") or STEP_S)
            for _ in range(max(1, round(seconds / STEP_S))):  # generating; a SIGTERM is handled in here
                if all(self.rid_to_state[rid].abort_requested for rid in rids):
                    break
                await asyncio.sleep(STEP_S)
            outputs = [_output(rid, self.rid_to_state[rid].abort_requested) for rid in rids]
            for ids, output in zip(input_ids, outputs, strict=True):
                if routes is not None and output["meta_info"]["finish_reason"]["type"] != "abort":
                    output["meta_info"]["routed_experts"] = routes.encoded(len(ids) + len(output["output_ids"]) - 1)
            return outputs
        finally:
            for rid in rids:
                self.rid_to_state.pop(rid, None)

    async def update_weights_from_disk(self, engine: Engine, model_path: str) -> tuple[bool, str, int]:
        self.auto_create_handle_loop()
        self._outputs_arrive()
        shapes = _tensor_shapes(model_path)
        if not shapes:
            return False, f"Failed to get weights iterator: no safetensors files at {model_path}.", 0
        engine.model_path = model_path  # model_config.model_path is set before loading
        failing = _failing_loads()
        if failing[0] > 0:
            failing[0] -= 1
            return False, "Failed to update weights: CUDA out of memory.\nRolling back to original weights.", 0
        for name, shape in shapes.items():
            if engine.shapes.get(name) != shape:
                return False, f"Failed to update weights: {name} {shape}.\nRolling back to original weights.", 0
        engine.updates.append(model_path)
        return True, "Succeeded to update model weights.", 0


def _output(rid: str, aborted: bool) -> dict:
    if aborted:
        finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        return {"output_ids": [], "meta_info": {"id": rid, "finish_reason": finish, "output_token_logprobs": []}}
    return {"output_ids": [2], "meta_info": {"id": rid, "finish_reason": {"type": "stop"},
                                             "output_token_logprobs": [(-0.1, 2, None)]}}  # fmt: skip


@dataclass
class RoutesModel:
    """The model's layout as RoutedExpertsCapturer.create reads it (hf_text_config) and which layers are MoE."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: list[int]

    @classmethod
    def of(cls, model_path: str) -> RoutesModel:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        layers = int(cfg["num_hidden_layers"])
        dense = set(cfg.get("mlp_only_layers") or []) | set(range(int(cfg.get("first_k_dense_replace") or 0)))
        experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts"))
        return cls(layers, int(cfg["num_experts_per_tok"]), experts, [i for i in range(layers) if i not in dense])

    def encoded(self, positions: int) -> str:
        import base64

        import numpy as np

        routes = np.zeros((positions, self.num_layers, self.top_k), dtype=np.int32)
        unwritten = os.environ.get("FAKE_SGLANG_ROUTES_UNWRITTEN")
        for layer in self.moe_layers:
            if unwritten is not None and layer == int(unwritten):
                continue
            for j in range(self.top_k):
                routes[:, layer, j] = (np.arange(positions) * 7 + layer + 3 * j) % self.num_experts
        return base64.b64encode(routes.tobytes()).decode("utf-8")


class Engine:
    def __init__(self, **kwargs: object) -> None:
        unknown = set(kwargs) - SERVER_ARGS
        assert not unknown, f"not ServerArgs fields: {unknown}"
        assert kwargs.get("dtype", "auto") in DTYPE_CHOICES, kwargs.get("dtype")
        assert kwargs.get("moe_runner_backend", "auto") in MOE_RUNNER_BACKEND_CHOICES, kwargs.get("moe_runner_backend")
        assert isinstance(kwargs.get("disable_radix_cache", False), bool), kwargs.get("disable_radix_cache")
        backend = kwargs.get("attention_backend")
        deterministic = kwargs.get("enable_deterministic_inference")
        if deterministic and backend is not None and backend not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"Currently only {sorted(DETERMINISTIC_ATTENTION_BACKEND_CHOICES)} attention backends are supported "
                f"for deterministic inference, but you explicitly specified '{backend}'."
            )
        if os.environ.get("FAKE_SGLANG_RECORD"):
            with open(os.environ["FAKE_SGLANG_RECORD"], "w") as f:
                json.dump(kwargs, f)
        time.sleep(float(os.environ.get("FAKE_SGLANG_START_S") or 0))  # _launch_subprocesses: loading the model
        self.tokenizer_manager = TokenizerManager()
        self.model_path = str(kwargs["model_path"])
        self.shapes = _tensor_shapes(self.model_path)
        self.updates: list[str] = []  # the model_path of every successful update_weights_from_disk
        self.routes = RoutesModel.of(self.model_path) if kwargs.get("enable_return_routed_experts") else None
        self.closed = False
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)

    def generate(
        self,
        prompt: list[str] | str | None = None,
        sampling_params: list[dict] | dict | None = None,
        input_ids: list[list[int]] | list[int] | None = None,
        *,  # upstream's next parameters (image_data, ...) are not modelled: return_logprob only by name here
        return_logprob: bool = False,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> list[dict]:
        assert not self.closed, "generate on an engine that was shut down"
        assert prompt is None and input_ids is not None, "moerl sends token ids (skip_tokenizer_init)"
        assert routed_experts_start_len == 0, "the fake models the whole sequence's routes only"
        routes = self.routes if return_routed_experts else None
        return self.loop.run_until_complete(self.tokenizer_manager.generate_request(input_ids, return_logprob, routes))

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        assert not self.closed, "update_weights_from_disk on an engine that was shut down"
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_disk(self, model_path))

    def shutdown(self) -> None:
        self.closed = True


def _tensor_shapes(model_path: str) -> dict[str, list[int]]:
    """name -> shape of every tensor in the dir's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    directory = Path(model_path)
    for path in sorted(directory.glob("*.safetensors")) if directory.is_dir() else []:
        with safe_open(str(path), framework="np") as f:
            shapes.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes
