"""Presets end to end on real processes: the staleness bound holds on every consumed
batch, no trajectory is lost or duplicated, and interrupted trajectories continue on
newer weights (segments of different versions)."""

import json
import struct
import zlib

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import main

from tests.experiments.e2e_args import SMALL

pytestmark = pytest.mark.slow

# A long-tailed workload (forced lognormal lengths) so generation spans train steps.
LONG_TAIL = [*SMALL, "--model.max-position-embeddings", "128", "--rollout.response-len",
             "lognormal", "--rollout.len-median", "16", "--rollout.len-max", "96",
             "--algo.max-new-tokens", "96", "--eval.every", "100"]
GROUP_SIZE = 8


def pool_records(path):
    """Every record of the partial response pool's append-only log."""
    data, pos, out = path.read_bytes(), 0, []
    while pos + 8 <= len(data):
        size, crc = struct.unpack_from("<II", data, pos)
        payload = data[pos + 8:pos + 8 + size]
        assert zlib.crc32(payload) == crc
        out.append(json.loads(payload))
        pos += 8 + size
    assert pos == len(data)
    return out


def check_run(run_dir, eta, steps):
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert r["eta"] == eta and r["staleness_max"] <= eta
        # The bound was checked on every trained response token.
        assert r["staleness_checked_tokens"] == sum(r["staleness_hist"])
        assert r["staleness_checked_max"] == r["staleness_max"]
        assert sum(r["staleness_hist"]) == r["tokens"] > 0
    consumed = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(consumed) == steps * 4
    uids = [t["uid"] for g in consumed for t in g["trajectories"]]
    assert len(uids) == len(set(uids)) == steps * 4 * GROUP_SIZE      # none twice
    assert len({g["group"] for g in consumed}) == len(consumed)
    for g in consumed:
        for t in g["trajectories"]:
            versions = [v for v, _ in t["segments"]]
            assert versions == sorted(versions) and min(versions) + eta >= g["consumed_version"]
    # Nothing lost: every trajectory that streamed a token is consumed (dropped from the
    # pool after its step) or still in the pool at the end with its tokens.
    log = pool_records(run_dir / "partial_responses.log")
    started = {r["uid"] for r in log if r["op"] == "start"}
    dropped = {r["uid"] for r in log if r["op"] == "drop"}
    streamed = {r["uid"] for r in log if r["op"] == "tokens"}
    assert dropped == set(uids)
    assert streamed <= started and set(uids) <= streamed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["unfinished_at_end"] == len(streamed - dropped - {
        r["uid"] for r in log if r["op"] == "finish"})
    return consumed, summary


def test_fnrl_routes_over_two_rollouts_within_the_bound(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    assert main(["--preset", "fnrl", "--steps", "4", "--run-dir", str(run_dir),
                 "--rollout.num-servers", "2", "--warm-start.cache-dir", cache_dir, *LONG_TAIL]) == 0
    consumed, summary = check_run(run_dir, eta=2, steps=4)
    assert summary["routed"] >= 4 * 4 * GROUP_SIZE
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert max(r["staleness_max"] for r in train) >= 1   # it did run ahead of the trainer


def test_partial_rollout_continues_interrupted_trajectories_on_new_versions(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    # Longer responses (median 60 tokens, up to 100: the task's prompts take up to 21 of
    # the 128) decoded 8 at a time, so generation is slower than a train step (however
    # loaded the machine) and trajectories are still running when the trainer publishes.
    longer = ["--rollout.len-median", "60", "--rollout.len-max", "100", "--algo.max-new-tokens",
              "100", "--rollout.max-num-seqs", "8"]
    assert main(["--preset", "partial_rollout", "--steps", "7", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, *LONG_TAIL, *longer]) == 0
    consumed, summary = check_run(run_dir, eta=2, steps=7)
    assert summary["interrupted"] > 0 and summary["continued"] > 0
    multi = [t for g in consumed for t in g["trajectories"] if len(t["segments"]) > 1]
    assert multi, "no consumed trajectory was interrupted and continued"
    for t in multi:
        versions = [v for v, _ in t["segments"]]
        assert len(set(versions)) == len(versions)   # each segment from another version
