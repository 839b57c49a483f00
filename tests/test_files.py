"""Files written atomically: the old content or the whole new one, never a part, no leftovers."""

from __future__ import annotations

import os
import stat

import pytest
from conftest import fill_disk_on_write

from whisper_train.files import atomic_output, write_atomically


def test_the_new_content_replaces_the_old_whole(tmp_path):
    target = tmp_path / "config.json"
    target.write_bytes(b"old content, longer than the new one")
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["config.json"]


def test_text_is_written_as_utf8(tmp_path):
    target = tmp_path / "words.txt"
    text = "naïve café, Größe, 日本語\n"
    write_atomically(target, text)
    assert target.read_bytes() == text.encode("utf-8")


def test_a_reader_sees_the_old_file_until_the_block_ends(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with atomic_output(target) as file:
        file.write(b"first half, ")
        file.flush()
        assert target.read_bytes() == b"old"
        file.write(b"second half")
    assert target.read_bytes() == b"first half, second half"


def test_an_error_in_the_block_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match="wrong digest"), atomic_output(target) as file:
        file.write(b"unverified bytes")
        raise ValueError("wrong digest")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.bin"]


def test_an_error_before_any_file_existed_leaves_the_folder_empty(tmp_path):
    with pytest.raises(KeyboardInterrupt), atomic_output(tmp_path / "model.bin") as file:
        file.write(b"part")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "generation_config.json"
    target.write_text('{"old": true}', encoding="utf-8")
    fill_disk_on_write(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        write_atomically(target, '{"new": true, "alignment_heads": [[1, 2]]}')
    monkeypatch.undo()
    assert target.read_text(encoding="utf-8") == '{"old": true}'
    assert os.listdir(tmp_path) == ["generation_config.json"]


def test_two_writers_of_one_file_never_share_a_temporary(tmp_path):
    # Two processes storing the same clip: each writes its own temporary, and whichever
    # finishes last leaves its whole content, never a mix of the two.
    target = tmp_path / "clip.safetensors"
    with atomic_output(target) as first:
        first.write(b"A" * 1000)
        with atomic_output(target) as second:
            second.write(b"B" * 10)
        first.write(b"A" * 1000)
        first.flush()
        assert target.read_bytes() == b"B" * 10
    assert target.read_bytes() == b"A" * 2000
    assert os.listdir(tmp_path) == ["clip.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_the_file_has_the_permissions_a_plain_write_gives(tmp_path, umask):
    # Not the owner-only 0o600 of tempfile.mkstemp: other users of a shared cache read it.
    previous = os.umask(umask)
    try:
        (tmp_path / "plain").write_bytes(b"x")
        write_atomically(tmp_path / "atomic", b"x")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "atomic").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o666 & ~umask
