"""The trainer's outputs: ``claim`` writes nothing and resolves only links inside the folder;
``publish`` leaves the old file and no temp file behind on any failure, and without
``overwrite`` never replaces a file, even one that appeared after the claim."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from swa_bench.train.outputs import OutputError, claim, publish


def test_claim_writes_nothing_and_names_checkpoint_and_card(tmp_path):
    outputs = claim(tmp_path / "deep" / "er" / "m.safetensors", overwrite=False)
    assert outputs.checkpoint == tmp_path / "deep" / "er" / "m.safetensors"
    assert outputs.card == tmp_path / "deep" / "er" / "m.md"
    assert list(tmp_path.iterdir()) == []  # the folder is made when writing, not claiming


def test_a_link_inside_the_folder_is_followed_to_its_file(tmp_path):
    (tmp_path / "run3.safetensors").write_bytes(b"old")
    (tmp_path / "latest.safetensors").symlink_to("run3.safetensors")
    with pytest.raises(OutputError, match="exists; --overwrite"):
        claim(tmp_path / "latest.safetensors", overwrite=False)
    outputs = claim(tmp_path / "latest.safetensors", overwrite=True)
    assert outputs.checkpoint == tmp_path / "run3.safetensors"
    publish(outputs.checkpoint, lambda tmp: tmp.write_bytes(b"new"), overwrite=True)
    assert (tmp_path / "latest.safetensors").is_symlink()
    assert (tmp_path / "run3.safetensors").read_bytes() == b"new"


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"old")

    def half_then_full(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match="No space left on device.*left as it was"):
        publish(path, half_then_full, overwrite=True)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_without_overwrite_a_file_that_appeared_is_kept(tmp_path):
    path = tmp_path / "m.md"
    claim(tmp_path / "m.safetensors", overwrite=False)
    path.write_text("written by someone else meanwhile")
    with pytest.raises(OutputError, match="appeared during training; kept"):
        publish(path, lambda tmp: tmp.write_text("the card"), overwrite=False)
    assert path.read_text() == "written by someone else meanwhile"
    assert [p.name for p in tmp_path.iterdir()] == ["m.md"]


def test_publish_creates_the_folder_and_a_readable_file(tmp_path):
    path = tmp_path / "a" / "b" / "m.md"
    publish(path, lambda tmp: tmp.write_text("card"), overwrite=False)
    assert path.read_text() == "card" and path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["m.md"]
