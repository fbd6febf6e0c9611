"""The controller journal's replay: exactly-once accounting across a controller crash."""

import json

from fnrl.control.journal import Journal, replay


def _problem(uid):
    return {"uid": uid, "prompt": f"{uid}=", "answer": "1", "level": 1}


def _write(path, *, trained_last: bool, torn: bool = False):
    j = Journal(path)
    for uid in ("a", "b", "c", "d"):
        j.write("fill", problem=_problem(uid), uids=[f"{uid}/0", f"{uid}/1"], lens=[None, None])
    j.write("drop", groups=["d"])
    j.write("consume", version=0, groups=["a"])
    j.write("trained", version=0)
    j.write("consume", version=1, groups=["b"])
    if trained_last:
        j.write("trained", version=1)
    j.close()
    if torn:
        with open(path, "a") as f:
            f.write('{"ev": "fill", "problem": {"uid": "e"')   # a crash mid-write


def test_a_step_the_trainer_never_checkpointed_is_outstanding_again(tmp_path):
    _write(tmp_path / "j.jsonl", trained_last=False)
    r = replay(tmp_path / "j.jsonl", trainer_version=1)
    assert r.prompts_taken == 4
    assert r.consumed == {"a"} and r.dropped == {"d"} and r.unlogged == ()
    assert [g.problem["uid"] for g in r.outstanding()] == ["b", "c"]


def test_a_step_the_trainer_checkpointed_unseen_counts_once(tmp_path):
    _write(tmp_path / "j.jsonl", trained_last=False)
    r = replay(tmp_path / "j.jsonl", trainer_version=2)
    assert r.consumed == {"a", "b"} and r.unlogged == ((1, ("b",)),)
    assert [g.problem["uid"] for g in r.outstanding()] == ["c"]


def test_a_torn_tail_is_ignored_and_a_missing_journal_is_a_fresh_run(tmp_path):
    _write(tmp_path / "j.jsonl", trained_last=True, torn=True)
    r = replay(tmp_path / "j.jsonl", trainer_version=2)
    assert r.prompts_taken == 4 and r.consumed == {"a", "b"}
    assert [g.uids for g in r.outstanding()] == [("c/0", "c/1")]
    assert replay(tmp_path / "none.jsonl", trainer_version=0).prompts_taken == 0
    lines = (tmp_path / "j.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["ev"] == "fill"


def test_records_after_a_torn_line_survive_the_next_restart(tmp_path):
    path = tmp_path / "j.jsonl"
    _write(path, trained_last=True, torn=True)
    # The restarted controller appends; a second restart must still see every record.
    j = Journal(path)
    j.write("fill", problem=_problem("f"), uids=["f/0", "f/1"], lens=[None, None])
    j.write("consume", version=2, groups=["c"])
    j.write("trained", version=2)
    j.close()
    r = replay(path, trainer_version=3)
    assert r.prompts_taken == 5 and r.consumed == {"a", "b", "c"}
    assert [g.problem["uid"] for g in r.outstanding()] == ["f"]
    assert r.trained_steps == 3
    for line in path.read_text().splitlines():
        json.loads(line)
