"""A stand-in for the `sglang` package (0.5.17) with what steps/sglang_engine.py relies on, on CPU:

- Engine(**kwargs) accepts only ServerArgs' field names that moerl passes (and records them to the JSON file
  named by $FAKE_SGLANG_RECORD), with `dtype` one of ServerArgs' choices;
- the engine's tokenizer_manager creates its asyncio loop on the first generate
  (TokenizerManager.auto_create_handle_loop) and registers SIGTERM on it; SGLang's handler drains the
  requests and then SIGKILLs its own process tree, the engine's process included (sigterm_watchdog ->
  kill_process_tree(os.getpid(), include_parent=True) -> psutil kill): exit 137;
- generate(input_ids, sampling_params, return_logprob) runs the loop until its outputs are ready; with
  $FAKE_SGLANG_SIGTERM_DURING_GENERATE set, the process receives SIGTERM while it runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

__version__ = "0.5.17"
SERVER_ARGS = {"model_path", "dtype", "skip_tokenizer_init", "tp_size", "ep_size", "mem_fraction_static",
               "enable_deterministic_inference", "random_seed", "log_level", "moe_a2a_backend", "deepep_mode"}
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

    def shutdown(self) -> None:
        pass
