"""The controller journal's replay: exactly-once accounting across a controller crash."""

import json

import pytest

from fnrl.control.journal import Journal, check, records, replay
from fnrl.shell.records import DamagedRecord, frame


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
    assert records(tmp_path / "j.jsonl")[0]["ev"] == "fill"


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
    assert len(records(path)) == len(path.read_text().splitlines())   # nothing fused


def _damage_line(path, index, new_line):
    lines = path.read_bytes().splitlines(keepends=True)
    offset = sum(len(line) for line in lines[:index])
    lines[index] = new_line
    path.write_bytes(b"".join(lines))
    return offset


@pytest.mark.parametrize("damage", [b'{"ev": "fill", "problem": {"uid": "x"\n',   # inserted junk
                                    None])                                        # a flipped byte
def test_damage_in_the_middle_refuses_with_the_offset_and_cuts_nothing(tmp_path, damage):
    path = tmp_path / "journal.jsonl"
    _write(path, trained_last=True)
    line = path.read_bytes().splitlines(keepends=True)[5]      # the first consume
    bad = damage or line.replace(b'"a"', b'"A"')                 # the checksum no longer holds
    offset = _damage_line(path, 5, bad)
    size = path.stat().st_size
    for read in (lambda: replay(path, trainer_version=2), lambda: Journal(path), lambda: check(path)):
        with pytest.raises(DamagedRecord) as err:
            read()
        assert err.value.offset == offset and err.value.index == 5 and err.value.valid_after == 3
        assert f"byte {offset}" in str(err.value) and str(path) in str(err.value)
    assert "second time" in str(err.value) and "fnrl.experiments.export" in str(err.value)
    assert path.stat().st_size == size   # the journal is not cut at the damage


def test_a_cut_last_line_is_a_torn_tail_and_old_journals_still_read(tmp_path):
    path = tmp_path / "journal.jsonl"
    _write(path, trained_last=True)
    whole = path.read_bytes()
    # What a crash leaves: a record cut short, or blocks of zeros (a power loss).
    for tail in (frame({"ev": "fill"})[:12].encode(), b"\x00" * 4096):
        path.write_bytes(whole + tail)
        assert len(records(path)) == 9
    Journal(path).close()   # cuts the tail
    assert path.read_bytes() == whole
    # A whole line that fails its check was damaged, even with nothing after it.
    path.write_bytes(whole + b"\x00\x17garbage\n")
    with pytest.raises(DamagedRecord, match=f"record 9 at byte {len(whole)}"):
        records(path)
    path.write_bytes(whole)
    # A journal written before framing (plain JSON lines) is read as it is.
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in records(path)))
    assert replay(old, trainer_version=2) == replay(path, trainer_version=2)


def test_any_single_damaged_byte_is_refused_or_is_the_torn_tail(tmp_path):
    """Every byte of every record, damaged alone, is refused (never replayed as if the
    record were not there: that would train groups twice), but the last end of line:
    without it the last record reads as cut short by a crash, and the replay is the one
    of the journal without it."""
    path = tmp_path / "journal.jsonl"
    _write(path, trained_last=True)
    whole = path.read_bytes()
    last = whole.rstrip(b"\n").rfind(b"\n") + 1
    (tmp_path / "cut.jsonl").write_bytes(whole[:last])
    without_last = replay(tmp_path / "cut.jsonl", trainer_version=2)
    for at in range(len(whole)):
        for flip in (0x01, 0x80):
            path.write_bytes(whole[:at] + bytes([whole[at] ^ flip]) + whole[at + 1:])
            try:
                got = replay(path, trainer_version=2)
            except DamagedRecord as err:
                assert err.offset <= at, (at, flip)
                continue
            assert at == len(whole) - 1, (at, flip)   # the last end of line alone
            assert got == without_last, (at, flip)


def _consumed_log(tmp_path, names):
    from fnrl.control.recovery import ConsumedLog
    from fnrl.data.partial_pool import PartialResponsePool

    pool = PartialResponsePool(tmp_path / "partial_responses.log")
    log = ConsumedLog(tmp_path / "trajectories.jsonl", pool)
    for name in names:
        log.log(name, 0, [])
    return log, pool


def test_trajectories_logged_by_a_step_the_journal_never_recorded_are_reconciled(tmp_path):
    """A controller stopped between a step's trajectories.jsonl lines and its journal
    record (a full disk, a kill): the next one keeps the lines of groups the trainer
    holds, so they are not logged twice, and cuts off those it does not hold."""
    log, pool = _consumed_log(tmp_path, ['a"x', "b", "c"])
    log.close()
    log, _ = _consumed_log(tmp_path, [])
    assert set(log.logged) == {'a"x', "b", "c"}
    assert log.reconcile(frozenset({'a"x', "b", "c"})) == 0
    assert log.reconcile(frozenset({'a"x', "b"})) == 1      # c's step is not held
    log.log("c", 1, [])                                      # trained again, logged once
    log.close()
    groups = [json.loads(line)["group"] for line in
              (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert groups == ['a"x', "b", "c"]
    pool.close()


def test_a_consumed_group_after_an_untrained_one_is_damage_and_nothing_is_cut(tmp_path):
    log, pool = _consumed_log(tmp_path, ["a", "b", "c"])
    size = (tmp_path / "trajectories.jsonl").stat().st_size
    with pytest.raises(DamagedRecord, match=r"trajectories.jsonl.*group b .*1 trained group"):
        log.reconcile(frozenset({"a", "c"}))
    assert (tmp_path / "trajectories.jsonl").stat().st_size == size
    log.close()
    pool.close()
