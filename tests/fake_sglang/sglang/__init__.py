"""A stand-in for the `sglang` package (0.5.17) with what steps/sglang_engine.py relies on, on CPU:

- Engine(**kwargs) accepts only ServerArgs' field names that moerl passes (and records them to the JSON file
  named by $FAKE_SGLANG_RECORD), with `dtype` one of ServerArgs' choices;
- the engine's tokenizer_manager creates its asyncio loop on the first generate
  (TokenizerManager.auto_create_handle_loop) and registers SIGTERM on it; SGLang's handler drains the
  requests and then SIGKILLs its own process tree, the engine's process included (sigterm_watchdog ->
  kill_process_tree(os.getpid(), include_parent=True) -> psutil kill): exit 137;
- generate(input_ids, sampling_params, return_logprob) runs the loop until its outputs are ready; with
  $FAKE_SGLANG_SIGTERM_DURING_GENERATE set, the process receives SIGTERM while it runs;
- update_weights_from_disk(model_path, load_format=None) (Engine, entrypoints/engine.py) returns
  TokenizerManager.update_weights_from_disk's (success, message, num_paused_requests), with the failures of
  ModelRunner's weight updater (model_runner_components/weight_updater.py): no safetensors at model_path ->
  "Failed to get weights iterator: ..."; a tensor the running model does not have, or of another shape ->
  "Failed to update weights: ...\nRolling back to original weights." (its model_path already points at the new
  dir); a tensor the dir lacks is no error (the old one stays). The running model is the safetensors headers
  of the model_path it started with.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
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
}
DTYPE_CHOICES = {"auto", "half", "float16", "bfloat16", "float", "float32"}


class TokenizerManager:
    def __init__(self) -> None:
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.gracefully_exit = False

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.event_loop = loop
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self.sigterm_handler)

    def sigterm_handler(self) -> None:
        self.gracefully_exit = True
        self.event_loop.call_soon(os.kill, os.getpid(), signal.SIGKILL)  # after draining: kill_process_tree


class Engine:
    def __init__(self, **kwargs: object) -> None:
        unknown = set(kwargs) - SERVER_ARGS
        assert not unknown, f"not ServerArgs fields: {unknown}"
        assert kwargs.get("dtype", "auto") in DTYPE_CHOICES, kwargs.get("dtype")
        if os.environ.get("FAKE_SGLANG_RECORD"):
            with open(os.environ["FAKE_SGLANG_RECORD"], "w") as f:
                json.dump(kwargs, f)
        self.tokenizer_manager = TokenizerManager()
        self.model_path = str(kwargs["model_path"])
        self.shapes = _tensor_shapes(self.model_path)
        self.updates: list[str] = []  # the model_path of every successful update_weights_from_disk

    def generate(self, input_ids: list, sampling_params: list, return_logprob: bool = False) -> list[dict]:
        self.tokenizer_manager.auto_create_handle_loop()

        async def run() -> list[dict]:
            sigterm = bool(os.environ.get("FAKE_SGLANG_SIGTERM_DURING_GENERATE"))
            if sigterm:
                os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(200 if sigterm else 1):  # generating; a SIGTERM is handled in here
                await asyncio.sleep(0.05)
            return [{"output_ids": [2], "meta_info": {"finish_reason": {"type": "stop"},
                                                      "output_token_logprobs": [(-0.1, 2, None)]}}
                    for _ in input_ids]  # fmt: skip

        return self.tokenizer_manager.event_loop.run_until_complete(run())

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        self.tokenizer_manager.auto_create_handle_loop()

        async def run() -> tuple[bool, str, int]:
            shapes = _tensor_shapes(model_path)
            if not shapes:
                return False, f"Failed to get weights iterator: no safetensors files at {model_path}.", 0
            self.model_path = model_path  # model_config.model_path is set before loading
            for name, shape in shapes.items():
                if self.shapes.get(name) != shape:
                    return False, f"Failed to update weights: {name} {shape}.\nRolling back to original weights.", 0
            self.updates.append(model_path)
            return True, "Succeeded to update model weights.", 0

        return self.tokenizer_manager.event_loop.run_until_complete(run())

    def shutdown(self) -> None:
        pass


def _tensor_shapes(model_path: str) -> dict[str, list[int]]:
    """name -> shape of every tensor in the dir's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    directory = Path(model_path)
    for path in sorted(directory.glob("*.safetensors")) if directory.is_dir() else []:
        with safe_open(str(path), framework="np") as f:
            shapes.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes
