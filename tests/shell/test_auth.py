"""Authenticated control: a message without the run's secret, with a wrong tag, tampered
with, stale or replayed is refused and logged, and the receiver serves valid ones after."""

from __future__ import annotations

import json
import logging
import threading

import ml_dtypes
import numpy as np
import pytest

from tests.shell.raw_zmq import raw_call

from fnrl.shell import auth, wire
from fnrl.shell.net import free_port


def run_auth(seconds: list[float] | None = None) -> auth.Authenticator:
    clock = (lambda: seconds[0]) if seconds is not None else None
    return auth.Authenticator(auth.new_secret(), **({"clock": clock} if clock else {}))


def test_a_sealed_request_and_its_reply_open():
    authn = run_auth()
    frames, nonce = authn.seal({"op": "train"}, [np.arange(4, dtype=np.uint8)])
    header, data = authn.open(frames)
    assert header == {"op": "train", "_nonce": nonce} and bytes(data[0]) == bytes(range(4))
    reply, _ = authn.seal({"ok": True}, reply_to=nonce)
    assert authn.open(reply, reply_to=nonce) == ({"ok": True}, [])


@pytest.mark.parametrize("forge, reason", [
    (lambda f, other: [f[1]], "no tag"),                                   # unsigned
    (lambda f, other: [b"x" * auth.TAG_LEN, *f[1:]], "no tag"),
    (lambda f, other: other.seal({"op": "train"})[0], "bad tag"),          # another run
    (lambda f, other: [f[0], f[1].replace(b"train", b"trainX"), f[2]], "bad tag"),  # header
    (lambda f, other: [f[0], f[1], b"\x01" + bytes(f[2])[1:]], "bad tag"),  # a covered frame
    (lambda f, other: [f[0], f[1]], "bad tag"),                            # a frame dropped
])
def test_a_forged_or_tampered_request_is_refused(forge, reason):
    authn = run_auth()
    frames, _ = authn.seal({"op": "train"}, [np.zeros(8, np.uint8)])
    with pytest.raises(auth.Refused, match=reason):
        authn.open(forge(frames, run_auth()))


def test_bulk_frames_are_covered_by_length_only():
    authn = run_auth()
    frames, _ = authn.seal({"op": "publish"}, [np.zeros(8, np.uint8)], bulk=True)
    authn.open([frames[0], frames[1], np.ones(8, np.uint8)])   # same length: accepted
    frames, _ = authn.seal({"op": "publish"}, [np.zeros(8, np.uint8)], bulk=True)
    with pytest.raises(auth.Refused, match="bad tag"):
        authn.open([frames[0], frames[1], np.ones(9, np.uint8)])
    with pytest.raises(auth.Refused, match="bad tag"):   # the flag itself is covered
        authn.open([frames[0].replace(auth.BULK, auth.COVERED, 1), *frames[1:]])


def test_stale_replayed_and_misdirected_messages_are_refused():
    now = [1000.0]
    authn = run_auth(now)
    frames, nonce = authn.seal({"op": "ping"})
    authn.open(frames)
    with pytest.raises(auth.Refused, match="replayed"):
        authn.open(frames)
    old, _ = authn.seal({"op": "ping"})
    now[0] += auth.MAX_AGE_S + 1
    with pytest.raises(auth.Refused, match="stale"):
        authn.open(old)
    ahead, _ = authn.seal({"op": "ping"})
    now[0] -= 2 * auth.MAX_AGE_S + 2                       # a clock far behind the sender's
    with pytest.raises(auth.Refused, match="stale"):
        authn.open(ahead)
    reply, _ = authn.seal({"ok": True}, reply_to=nonce)
    with pytest.raises(auth.Refused, match="another request"):
        authn.open(reply, reply_to="0123456789abcdef")


def test_each_attempt_gets_a_fresh_secret_that_spawned_roles_inherit(monkeypatch):
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    first = auth.process_auth()                   # made on first use, into the environment
    assert auth.with_secret({})[auth.ENV_VAR] == first.secret.hex()
    auth.start_run()
    second = auth.process_auth()
    assert second.secret != first.secret and len(second.secret) == 32
    frames, _ = first.seal({"cmd": "train"})
    with pytest.raises(auth.Refused, match="bad tag"):   # an old attempt's message
        second.open(frames)
    assert auth.with_secret({auth.ENV_VAR: "ab" * 16})[auth.ENV_VAR] == "ab" * 16
    assert second.secret.hex() not in repr(second)
    assert auth.api_key() != second.secret.hex() and len(auth.api_key()) == 64


def test_a_role_without_a_secret_refuses_to_start(monkeypatch):
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    with pytest.raises(RuntimeError, match="FNRL_RUN_SECRET is not set"):
        wire.RoleServer(f"tcp://127.0.0.1:{free_port()}", role="trainer")


@pytest.fixture
def echo_server():
    """A RoleServer in a thread echoing each request's arrays, as a role serves."""
    address = f"tcp://127.0.0.1:{free_port()}"
    server = wire.RoleServer(address, role="echo", authn=auth.process_auth())
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            header, arrays = server.recv()
            server.reply({"cmd": header["cmd"]}, arrays)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield address
    stop.set()
    client = wire.RoleClient("echo", address)   # wakes the loop up to see `stop`
    client.call({"cmd": "bye"}, timeout_s=5)
    client.close()
    thread.join(5)
    server.close()


def test_a_role_refuses_and_logs_bad_requests_then_serves_good_ones(echo_server, caplog):
    authn = auth.process_auth()
    good, _ = authn.seal({"cmd": "train", "_arrays": []})
    other, _ = run_auth().seal({"cmd": "train", "_arrays": []})
    forged = {
        "no tag": [good[1]],
        "bad tag": other,                                            # wrong secret
        "bad tag (another": [good[0], good[1].replace(b"train", b"shutdown")],  # tampered
    }
    with caplog.at_level(logging.WARNING, logger="fnrl.auth"):
        for reason, frames in forged.items():
            assert reason in auth.refusal_reason(raw_call(echo_server, frames))
        assert auth.refusal_reason(raw_call(echo_server, good)) is None
        assert "replayed" in auth.refusal_reason(raw_call(echo_server, good))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all("on echo tcp://127.0.0.1:" in l for l in lines), lines
    assert all("from 127.0.0.1" in l for l in lines), lines
    client = wire.RoleClient("echo", echo_server)
    try:   # still serving, arrays of every dtype and shape intact
        arrays = {"x_BxT": np.arange(6, dtype=np.int32).reshape(2, 3),
                  "w": np.arange(3).astype(ml_dtypes.bfloat16), "s": np.float32(2.5),
                  "empty": np.zeros((0, 4), np.float32)}
        nonce = wire.send(client._sock, {"cmd": "echo"}, arrays)
        reply, got = wire.recv(client._sock, timeout_s=5, role="echo", reply_to=nonce)
        assert reply == {"cmd": "echo"}
        for name, a in arrays.items():
            assert got[name].dtype == a.dtype and got[name].shape == np.shape(a)
            assert np.array_equal(got[name], a)
    finally:
        client.close()


def test_a_client_refuses_a_reply_from_a_peer_without_the_secret():
    address = f"tcp://127.0.0.1:{free_port()}"
    impostor = wire.RoleServer(address, role="impostor", authn=run_auth())
    client = wire.RoleClient("trainer", address)
    errors: list[str] = []

    def call():
        try:
            client.call({"cmd": "init"}, timeout_s=5)
        except wire.RoleError as err:
            errors.append(str(err))

    try:
        thread = threading.Thread(target=call)
        thread.start()
        sock = impostor._sock
        assert sock.poll(5000)
        frames = sock.recv_multipart()     # the impostor cannot check it; it answers anyway
        nonce = json.loads(frames[1])["_nonce"]
        sock.send_multipart(impostor.authn.seal({"version": 0}, reply_to=nonce)[0])
        thread.join(10)
        assert errors == ["trainer's reply refused: bad tag (another run's secret, or a "
                          "changed message)"]
    finally:
        client.close()
        impostor.close()
