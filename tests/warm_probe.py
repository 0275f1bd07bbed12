"""A pod program for tests/test_local_warm_start.py: prints what a fresh `python -m` process would see."""

import atexit
import json
import os
import random
import sys
import threading
import time

import numpy
import torch

if __name__ == "__main__":
    # One write for the whole line: torchrun's ranks share the pod's stdout, and under PYTHONUNBUFFERED
    # print's text and its newline are separate writes that another rank's line can land between.
    sys.stdout.write(
        json.dumps(
            {
                "argv": sys.argv,
                "cwd": os.getcwd(),
                "path0": sys.path[0],
                "name": __name__,
                "env": {k: os.environ.get(k) for k in ("PROBE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")},
                "home": os.environ.get("HOME"),
                "random": random.random(),
                "numpy": float(numpy.random.random()),
                "threads": torch.get_num_threads(),
                "stdin": sys.stdin.read(),
                "pgid_is_own": os.getpgid(0) == os.getsid(0),
                "preloaded_main_copy": "tests.warm_probe" in sys.modules,
            }
        )
        + "\n"
    )
    behaviour, rank = os.environ.get("PROBE"), os.environ.get("RANK")
    # argv "--behave NAME" instead of PROBE: pods of one environment share one warm server.
    if sys.argv[1:2] in (["--behave"], ["--end"]):
        behaviour = sys.argv[2]
    if behaviour == "sleep" or (behaviour == "rank-fail" and rank == "0"):
        sys.stderr.write(f"{os.getpid()}\n")  # one write: print's text and newline could interleave with the other
        sys.stderr.flush()  # rank's and make one number of two pids
        time.sleep(60)
    if behaviour == "rank-fail" and rank == "1":
        sys.exit(5)
    if behaviour == "fail":
        raise RuntimeError("probe failed on purpose")
    # How the process ends (argv "--end NAME", so that one server serves them all): what a warm pod's exit
    # (warm_server.exit_without_teardown) must still do.
    if behaviour == "atexit":
        atexit.register(lambda: print("atexit callback ran"))
    if behaviour == "thread":  # a non-daemon thread still running when the module returns
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
    if behaviour == "buffered":  # without PYTHONUNBUFFERED: still in the buffer at exit
        print("buffered line")
    if behaviour == "message":
        sys.exit("probe says goodbye")
    if behaviour == "interrupt":
        raise KeyboardInterrupt
    if behaviour == "exit-code":
        sys.exit(7)
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
