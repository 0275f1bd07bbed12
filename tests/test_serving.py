"""steps/run/serving.py's JsonServer with main_thread: operations run on the thread that calls run_operations (the
trainer's rank 0 broadcasts from there), its idle callback runs there between calls, and a refused or
unavailable call reaches the client as MoerlError or ServerLost."""

from __future__ import annotations

import threading

import pytest

from steps.errors import MoerlError
from steps.run import serving


def entry(server: serving.JsonServer) -> serving.Registration:
    return serving.Registration("probe", f"127.0.0.1:{server.port}", "i", "file:///run", "wf", 0, 0.0)


def test_main_thread_operations_and_idle_calls_run_on_the_serving_thread():
    stop = threading.Event()
    seen: dict[str, list] = {"op": [], "idle": []}
    answers: dict[str, object] = {}

    def echo(body: dict) -> dict:
        seen["op"].append(threading.get_ident())
        if body.get("refuse"):
            raise MoerlError("refused on purpose")
        if body.get("busy"):
            raise serving.Unavailable("stopping")
        return {"echo": body["x"]}

    def idle() -> None:
        seen["idle"].append(threading.get_ident())
        if answers.get("done"):
            stop.set()  # the client has had its answers: end run_operations

    server = serving.JsonServer({"echo": echo}, lambda: {"ready": True}, main_thread=True)
    server.serve_in_background()

    def client() -> None:
        answers["ok"] = serving.call(entry(server), "echo", {"x": 7})
        for case in ("refuse", "busy"):
            try:
                serving.call(entry(server), "echo", {case: True})
            except (MoerlError, serving.ServerLost) as err:
                answers[case] = err
        answers["done"] = True

    thread = threading.Thread(target=client)
    thread.start()
    try:
        server.run_operations(stop, idle=idle, idle_every_s=0.0)  # until idle sees the client done
    finally:
        thread.join()
        server.close()
    here = threading.get_ident()
    assert answers["ok"] == {"echo": 7}
    assert isinstance(answers["refuse"], MoerlError) and "refused on purpose" in str(answers["refuse"])
    assert isinstance(answers["busy"], serving.ServerLost)  # 503: the client takes it for a lost server
    assert seen["op"] == [here] * 3 and seen["idle"] and set(seen["idle"]) == {here}


@pytest.mark.parametrize("path", ["/nothing", "/health"])
def test_health_answers_and_unknown_operations_are_refused(path):
    server = serving.JsonServer({}, lambda: {"ready": True, "instance": "i", "run": "file:///run"})
    server.serve_in_background()
    try:
        if path == "/health":
            assert serving.health(entry(server))["ready"] is True
        else:
            with pytest.raises(serving.ServerLost, match="no such operation"):
                serving.call(entry(server), path.lstrip("/"), {})
    finally:
        server.close()


def test_a_trainer_whose_launcher_is_gone_stops_itself(tmp_path, monkeypatch):
    """trainer.server_idle_exit_s: a trainer whose job outlived its launcher (its heartbeat still for that
    long) ends (rank 0 stops serving and tells the other ranks to stop) instead of holding its nodes."""
    from types import SimpleNamespace

    from steps.store.object_store import Store
    from steps.training import trainer_server

    monkeypatch.setattr(trainer_server, "HEARTBEAT_S", 0.0)  # check at every idle poll
    lines: list[str] = []
    mesh = SimpleNamespace(rank=0, ep_size=1)
    run = Store.open(tmp_path.as_uri())
    run.put_json("launchers/wf/trainer-server.json", {"beat": 1})  # written once, then never again
    service = trainer_server.TrainerService(run, mesh, 0, None, None, lines.append)
    server = serving.JsonServer({"update": service.update}, service.health, main_thread=True)
    server.serve_in_background()
    try:
        service.serve(server, trainer_server.LauncherWatch(run, "launchers/wf/trainer-server.json", 0.01))
    finally:
        server.close()
    assert service.stopping.is_set()
    assert lines and "the launcher is gone" in lines[-1] and "--idle-exit-s 0.01" in lines[-1]