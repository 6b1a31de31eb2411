"""route-serve and sleeping servers, over real HTTP: emulated vLLM servers in sleep mode and a
real route-serve following state.json. A sleeper gets no request while an awake server is
there, one put to sleep by hand is left alone from the next scrape, the router wakes the only
server of a model itself (the request waits in its queue, never parked on the engine), and a
draining server finishes what it runs and gets nothing new."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from pathlib import Path

import pytest

from fleetctl.fleet.state import Sleeper, State, server_name
from fleetctl.fleet.statedir import StateDir
from tests.daemon.test_route_serve import _wait_for
from tests.daemon.test_state_reload import _deployments, _inventory, _put, _start
from tests.procs import NAME, SCALE, Emulator

DEV = {"VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture
def sleepy(tmp_path):
    """Two emulated servers started with sleep mode, in dev mode (the sleep endpoints)."""
    emus = [Emulator(tmp_path, "--enable-sleep-mode", env=DEV) for _ in range(2)]
    try:
        for e in emus:
            e.wait_healthy()
        yield emus
    finally:
        for e in emus:
            e.stop()


def _with_sleep_mode(d):  # type: ignore[no-untyped-def]
    """The deployment as apply starts it for sleep mode: route-serve may wake it."""
    server = dataclasses.replace(d.server, args_tail=(*d.server.args_tail, "--enable-sleep-mode"))
    return dataclasses.replace(d, server=server)


def _fleet(tmp_path: Path, emus: list[Emulator]):  # type: ignore[no-untyped-def]
    inv = _inventory(tmp_path)
    return inv, [_with_sleep_mode(d) for d in _deployments(inv, emus)]


def _sample(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from a Prometheus page, or None when it is not there."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def _arrivals(emu: Emulator) -> dict[str, float]:
    _, body = emu.request("GET", "/metrics")
    text = body.decode()
    return {
        state: _sample(text, "fleetctl_emulator_arrivals_total", engine_state=state) or 0.0
        for state in ("awake", "parked")
    }


def _state(r, emu: Emulator) -> str:  # type: ignore[no-untyped-def]
    """The state route-serve's /metrics give the server."""
    text = r.metrics()
    for state in ("awake", "asleep", "waking", "starting", "draining"):
        if _sample(text, "fleetctl_backend_state", backend=emu.base, state=state) == 1.0:
            return state
    return "none"


def _sleep(emu: Emulator, level: int = 1) -> None:
    status, body = emu.request("POST", f"/sleep?level={level}")
    assert status == 200, body


@pytest.mark.parametrize("policy", ["round-robin", "hardware-aware"])
def test_a_sleeper_gets_nothing_while_an_awake_server_is_there(sleepy, tmp_path, policy):
    """state.json lists one server awake and one asleep: every request goes to the awake
    one, and the sleeper sees none (its arrival counter stays 0), whatever the policy."""
    awake, asleep = sleepy
    inv, (one, two) = _fleet(tmp_path, sleepy)
    _sleep(asleep)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, (one,), asleep=(Sleeper(two, 1),)))
    r = _start(inv, sdir.root, tmp_path / "router.log", "--policy", policy)
    try:
        assert _state(r, asleep) == "asleep" and _state(r, awake) == "awake"
        for _ in range(10):
            status, _, body = r.complete()
            assert status == 200, body
        assert _arrivals(asleep) == {"awake": 0, "parked": 0}
        assert _arrivals(awake)["awake"] == 10
    finally:
        r.stop()


def test_the_router_wakes_a_models_only_server_and_never_parks_a_request(sleepy, tmp_path):
    """The only server of the model asleep (level 2, the longer wake): a request makes
    route-serve ask for one wake and wait for it; the answer comes after about the
    emulator's own wake seconds, and the engine never held a request while asleep (its
    parked counter stays 0, and its own TTFT has no wake in it)."""
    emu, _ = sleepy
    inv, (one, _) = _fleet(tmp_path, sleepy)
    _sleep(emu, level=2)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, (), asleep=(Sleeper(one, 2),)))
    r = _start(inv, sdir.root, tmp_path / "router.log")
    try:
        assert _state(r, emu) == "asleep"
        started = time.monotonic()
        status, _, body = r.complete(max_tokens=2)
        took = time.monotonic() - started
        assert status == 200, body
        _, page = emu.request("GET", "/metrics")
        text = page.decode()
        wake_emulated = _sample(
            text, "vllm:sleep_mode_operation_duration_seconds_sum", operation="wake"
        )
        assert wake_emulated is not None and wake_emulated > 0
        wake_wall = wake_emulated / float(SCALE)  # the emulator's seconds run SCALE x faster
        # The client waited for the wake, and for little else.
        assert wake_wall * 0.9 <= took <= wake_wall + 5.0, (took, wake_wall)
        engine_ttft = _sample(text, "vllm:time_to_first_token_seconds_sum")
        assert engine_ttft is not None and engine_ttft < wake_emulated  # not parked
        assert _arrivals(emu) == {"awake": 1, "parked": 0}
        page_r = r.metrics()
        assert _sample(page_r, "fleetctl_backend_wakes_total", backend=emu.base) == 1.0
        assert _state(r, emu) == "awake"
        assert r.complete()[0] == 200
        assert _sample(r.metrics(), "fleetctl_backend_wakes_total", backend=emu.base) == 1.0
    finally:
        r.stop()


def test_a_server_put_to_sleep_by_hand_gets_nothing_after_the_next_scrape(sleepy, tmp_path):
    """Both awake in state.json; one is put to sleep through its own dev endpoint: once a
    scrape reads its vllm:engine_sleep_state, round-robin sends it nothing (before, the
    requests sent there were parked until someone woke it)."""
    _, nap = sleepy
    inv, deployments = _fleet(tmp_path, sleepy)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, tuple(deployments)))
    r = _start(inv, sdir.root, tmp_path / "router.log", "--policy", "round-robin")
    try:
        _wait_for(lambda: _state(r, nap) == "awake", "route-serve to list the server awake")
        _sleep(nap)
        _wait_for(lambda: _state(r, nap) == "asleep", "the scrape that finds it asleep")
        before = _arrivals(nap)
        for _ in range(6):
            status, _, body = r.request(
                "POST",
                "/v1/completions",
                {"model": NAME, "prompt": "hello", "max_tokens": 4},
                timeout=20,
            )
            assert status == 200, body
        assert _arrivals(nap) == before and before["parked"] == 0
    finally:
        r.stop()


def test_a_draining_server_finishes_its_stream_and_gets_nothing_new(sleepy, tmp_path):
    """A stream runs on one server; state.json then lists that server as draining: the
    requests that follow go to the other (round-robin would alternate), and the stream ends
    whole."""
    a, b = sleepy
    inv, (da, db) = _fleet(tmp_path, sleepy)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, (da, db), draining=frozenset({server_name(da)})))
    r = _start(inv, sdir.root, tmp_path / "router.log", "--policy", "round-robin")
    try:
        assert _state(r, a) == "draining"
        answer: list[tuple[int, bytes]] = []

        def stream() -> None:
            body = {"model": NAME, "prompt": "hi", "max_tokens": 6000, "stream": True}
            status, _, got = r.request("POST", "/v1/completions", body, timeout=120)
            answer.append((status, got))

        t = threading.Thread(target=stream)
        t.start()
        _wait_for(
            lambda: (
                _sample(r.metrics(), "fleetctl_backend_outstanding_requests", backend=b.base) == 1.0
            ),
            "the stream on the second server",
        )
        _put(
            sdir.state_path,
            json.dumps(State(2, (da, db), draining=frozenset({server_name(db)})).to_json()),
        )
        _wait_for(lambda: _state(r, b) == "draining", "the reload that drains it")
        on_b = _arrivals(b)["awake"]
        for _ in range(5):
            assert r.complete()[0] == 200
        assert _arrivals(b)["awake"] == on_b == 1
        assert _arrivals(a)["awake"] == 5
        t.join(timeout=120)
        assert answer and answer[0][0] == 200
        assert answer[0][1].rstrip().endswith(b"data: [DONE]"), answer[0][1][-200:]
    finally:
        r.stop()


def test_a_sleeper_that_joins_on_a_reload_gets_no_warm_up_requests(sleepy, tmp_path):
    """With router.warmup_requests, a server that joins is sent warm-up completions before
    clients' requests; a sleeper joining (state.json lists it asleep) is admitted without
    them: they would wait on its paused engine."""
    _, asleep = sleepy
    inv, (one, two) = _fleet(tmp_path, sleepy)
    inv.write_text(
        inv.read_text().replace("router: {aging:", "router: {warmup_requests: 2, aging:")
    )
    _sleep(asleep)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, (one,)))
    r = _start(inv, sdir.root, tmp_path / "router.log")
    try:
        _put(sdir.state_path, json.dumps(State(2, (one,), asleep=(Sleeper(two, 1),)).to_json()))

        def healthy() -> int:
            return int(json.loads(r.request("GET", "/health")[2])["healthy"])

        _wait_for(lambda: healthy() == 2, "the sleeper admitted")
        assert _state(r, asleep) == "asleep"
        assert _arrivals(asleep) == {"awake": 0, "parked": 0}
        assert r.complete()[0] == 200
    finally:
        r.stop()


def test_a_wake_someone_else_asked_is_waited_for_not_asked_again(tmp_path):
    """The autopilot (here the test) wakes the model's only server; route-serve reads the
    wake under way from vllm:sleep_mode_operations_in_flight, marks it waking, and a request
    that comes meanwhile waits for that wake: route-serve asks none of its own, and the
    engine parks nothing. Emulated at time scale 1: a level-2 wake of seconds."""
    emu = Emulator(tmp_path, "--enable-sleep-mode", "--time-scale", "1", env=DEV)
    try:
        emu.wait_healthy()
        inv, (one,) = _fleet(tmp_path, [emu])
        _sleep(emu, level=2)
        sdir = StateDir(tmp_path / ".fleetctl")
        sdir.save_state(State(1, (), asleep=(Sleeper(one, 2),)))
        r = _start(inv, sdir.root, tmp_path / "router.log")
        try:
            assert _state(r, emu) == "asleep"
            woken: list[int] = []
            waker = threading.Thread(
                target=lambda: woken.append(emu.request("POST", "/wake_up", timeout=60)[0])
            )
            waker.start()
            _wait_for(lambda: _state(r, emu) == "waking", "the scrape that sees the wake")
            status, _, body = r.complete(max_tokens=2)
            assert status == 200, body
            waker.join(timeout=60)
            assert woken == [200]
            assert _sample(r.metrics(), "fleetctl_backend_wakes_total", backend=emu.base) is None
            assert _arrivals(emu) == {"awake": 1, "parked": 0}
        finally:
            r.stop()
    finally:
        emu.stop()
