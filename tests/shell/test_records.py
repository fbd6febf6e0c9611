"""Line logs that tell a torn tail from damage: appending after a crash, and the lenient
reader of report logs."""

import errno
import json

import pytest

from fnrl.shell import records
from fnrl.shell.files import DiskFull, SpaceReserve, no_space, remove_unfinished_saves


@pytest.mark.parametrize("tail", [b"", b'{"a": 3', b"0badc0de {", b"x" * (3 << 20)])
def test_append_cuts_a_torn_last_line_and_nothing_else(tmp_path, tail):
    """Whatever a crash cut short (even a fragment longer than one read chunk) goes; every
    whole line stays; a line appended after it is whole too."""
    path = tmp_path / "log.jsonl"
    whole = records.frame({"a": 1}) + json.dumps({"a": 2}) + "\n"
    path.write_bytes(whole.encode() + tail)
    with records.append(path) as f:
        f.write(records.frame({"a": 4}))
    assert [r["a"] for r in records.read(path).records] == [1, 2, 4]


def test_append_to_a_file_that_is_all_fragment_or_missing(tmp_path):
    (tmp_path / "cut.jsonl").write_bytes(b'{"a": ')
    for name in ("cut.jsonl", "new.jsonl"):
        with records.append(tmp_path / name) as f:
            f.write(records.frame({"a": 1}))
        assert records.read(tmp_path / name).records == [{"a": 1}]


def test_read_skipping_names_damage_in_the_middle_but_not_a_torn_tail(tmp_path):
    path = tmp_path / "faults.jsonl"
    good = [records.frame({"i": i}) for i in range(4)]
    body = good[0] + "garbage\n" + good[1] + good[2].replace('"i"', '"j"') + good[3]
    path.write_text(body + '00000000 {"i": 9')
    got, damaged = records.read_skipping(path)
    assert [r["i"] for r in got] == [0, 1, 3]
    assert damaged == [(len(good[0]), "not JSON"),
                       (len(good[0]) + len("garbage\n") + len(good[1]), "checksum mismatch")]
    # The strict reader refuses the same file, naming the first damaged record.
    with pytest.raises(records.DamagedRecord, match=f"record 1 at byte {len(good[0])}"):
        records.read(path)


def test_a_full_disk_is_told_apart_through_the_exceptions_it_caused(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as err:
            raise RuntimeError("the save failed") from err
    except RuntimeError as wrapped:
        assert no_space(wrapped)
    assert not no_space(OSError(errno.EACCES, "Permission denied"))
    said = DiskFull("the controller wrote its logs", tmp_path, full)
    assert not isinstance(said, OSError) and no_space(said)   # never taken for a role failure
    assert str(tmp_path) in str(said) and "MiB free" in str(said) and said.free_bytes > 0


def test_the_space_reserve_holds_real_blocks_until_released(tmp_path):
    reserve = SpaceReserve(tmp_path, nbytes=1 << 20)
    assert reserve.path.stat().st_blocks * 512 >= 1 << 20
    reserve.release()
    reserve.release()   # twice is fine: the stop and the end may both give it back
    assert not reserve.path.exists()


def test_unfinished_saves_go_and_finished_steps_stay(tmp_path):
    for name in ("3", "4", "5.orbax-checkpoint-tmp-1700000000"):
        (tmp_path / name).mkdir()
    assert remove_unfinished_saves(tmp_path) == ["5.orbax-checkpoint-tmp-1700000000"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]
    assert remove_unfinished_saves(tmp_path / "none") == []
