"""Step server-probe: the readinessProbe of a long-lived server (`exec`), run in the server's container.

    python -m steps.server_probe --run URI --workflow NAME --server NAME

Exit 0 when the server `NAME` of that Workflow is registered in the run store and its `/health` answers, as
that registration's instance, that it is ready (steps/run/serving.py); 1 otherwise. An exec probe, not an
httpGet: a server listens on a port it is given by the system (several share one address on the local
executor), which only its registration knows.
"""

from __future__ import annotations

import argparse

from steps.errors import run_cli
from steps.run import serving
from steps.store.object_store import Store


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.server_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI")
    parser.add_argument("--workflow", required=True, help="the server's Workflow")
    parser.add_argument("--server", required=True, help="the server's name: rollout-server-K, trainer")
    args = parser.parse_args()
    return 0 if serving.live_servers(Store.open(args.run), args.workflow, args.server, exact=True) else 1


if __name__ == "__main__":
    run_cli(main)
