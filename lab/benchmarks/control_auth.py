"""The cost of authenticating control messages (fnrl.shell.auth), side by side in one run.

    python -m lab.benchmarks.control_auth [--repeats 20000]

For typical control messages it prints, per message, the time to seal and open it (HMAC-
SHA256 of the run's key, a nonce and the replay check) beside the time to build and parse
the same message unsigned (JSON only, what the wire did before), and the round trip of a
ZeroMQ request/reply over TCP on loopback with and without the tag (the unsigned one uses
the old wire format: one JSON frame plus raw frames). A train batch's arrays are covered
by the tag, so its row shows the cost per MiB too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import zmq


from fnrl.shell import auth
from fnrl.shell.net import free_port

HEADERS = {
    "relay ping": ({"op": "ping"}, {}),
    "relay commit": ({"op": "commit", "version": 12, "segment": "fnrl-relay-relay0-1234-inbox1",
                      "tensors": [{"name": f"model.layers.{i}.mlp.up_proj.weight",
                                   "shape": [896, 4864], "dtype": "bfloat16"}
                                  for i in range(24)], "wait": "held"}, {}),
    "trainer train (64x1024 batch)": ({"cmd": "train"}, {
        name: np.zeros((64, 1024), dtype) for name, dtype in
        (("input_BxT", np.int32), ("target_BxT", np.int32), ("mask_BxT", np.float32),
         ("logp_BxT", np.float32), ("version_BxT", np.int32))}),
}


def per_call_us(fn, repeats: int) -> float:
    """Median of 5 timings of `repeats` calls, in microseconds per call."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        runs.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(runs)


def frames_of(arrays: dict) -> list:
    return [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays.values()]


def unsigned(header: dict, arrays: dict) -> None:
    specs = [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in arrays.items()]
    raw = json.dumps({**header, "_arrays": specs}).encode()
    json.loads(raw)
    frames_of(arrays)


def signed(authn: auth.Authenticator, header: dict, arrays: dict) -> None:
    specs = [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in arrays.items()]
    frames, _ = authn.seal({**header, "_arrays": specs}, frames_of(arrays))
    authn.open(frames)


def round_trip_us(header: dict, arrays: dict, *, sign: bool, repeats: int) -> float:
    """One REQ/REP round trip over TCP on loopback (the request signed, the reply too)."""
    authn = auth.Authenticator(auth.new_secret())
    ctx = zmq.Context.instance()
    address = f"tcp://127.0.0.1:{free_port()}"
    rep, req = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    rep.bind(address)
    req.connect(address)

    def serve():
        while True:
            frames = rep.recv_multipart(copy=False)
            if sign:
                request, _ = authn.open(frames)
                reply, _ = authn.seal({"ok": True}, reply_to=request["_nonce"])
            else:
                request = json.loads(bytes(frames[0]))
                reply = [json.dumps({"ok": True}).encode()]
            rep.send_multipart(reply)
            if request.get("op") == "stop":
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def call():
        if sign:
            frames, nonce = authn.seal(header, frames_of(arrays))
            req.send_multipart(frames, copy=False)
            authn.open(req.recv_multipart(), reply_to=nonce)
        else:
            req.send_multipart([json.dumps(header).encode(), *frames_of(arrays)], copy=False)
            json.loads(req.recv())

    try:
        return per_call_us(call, repeats)
    finally:
        if sign:
            req.send_multipart(authn.seal({"op": "stop"})[0])
        else:
            req.send_multipart([b'{"op": "stop"}'])
        req.recv_multipart()
        thread.join()
        rep.close()
        req.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20000)
    args = parser.parse_args()
    authn = auth.Authenticator(auth.new_secret())
    print(f"{'message':32s} {'bytes':>9s} {'unsigned us':>12s} {'sealed+opened us':>17s} "
          f"{'RTT before us':>14s} {'RTT signed us':>14s}")
    for name, (header, arrays) in HEADERS.items():
        repeats = args.repeats if not arrays else max(50, args.repeats // 200)
        size = len(json.dumps(header)) + sum(a.nbytes for a in arrays.values())
        before = per_call_us(lambda: unsigned(header, arrays), repeats)
        after = per_call_us(lambda: signed(authn, header, arrays), repeats)
        rtt_before = round_trip_us(header, arrays, sign=False, repeats=repeats // 4 or 1)
        rtt_after = round_trip_us(header, arrays, sign=True, repeats=repeats // 4 or 1)
        print(f"{name:32s} {size:9d} {before:12.1f} {after:17.1f} {rtt_before:14.1f} "
              f"{rtt_after:14.1f}")
        if arrays:
            mib = sum(a.nbytes for a in arrays.values()) / 2**20
            print(f"{'':32s} covered arrays: {(after - before) / mib:.0f} us per MiB")


if __name__ == "__main__":
    main()
