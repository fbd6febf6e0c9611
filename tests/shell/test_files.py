"""Atomic replacement and log tails."""

from __future__ import annotations

import os

from fnrl.shell.files import log_tail, write_atomic


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "specs.json"
    write_atomic(path, "old")
    write_atomic(path, b"new", fsync=True)
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["specs.json"]


def test_a_reader_sees_the_old_file_until_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "specs.json"
    path.write_text("old")
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (seen.append(path.read_text()),
                                                     real_replace(a, b)))
    write_atomic(path, "new")
    assert seen == ["old"] and path.read_text() == "new"


def test_log_tail_keeps_the_last_lines(tmp_path):
    log = tmp_path / "role.log"
    log.write_text("".join(f"line {i}\n" for i in range(5000)))
    tail = log_tail(log, lines=3)
    assert tail == f"; last lines of {log}:\nline 4997\nline 4998\nline 4999"
    assert log_tail(None) == "" and log_tail(tmp_path / "missing.log") == ""
