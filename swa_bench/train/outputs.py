"""Where the trainer's checkpoint and card go: claimed before training, written atomically.

Minutes of training must not end in a refusal, and no file may be lost to them: ``claim`` checks
both paths up front (nothing written) and ``publish`` writes each through a temp file in the
same folder moved into place only once complete, so a kill or a full disk leaves the old file
as it was and no temp file behind. Without ``overwrite``, a file already there is never replaced:
the move is a hard link, which fails on an existing name (no window between check and write).
A symlink is followed only to a file in its own folder; the card is never the checkpoint.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swa_bench.train.card import CARD_SUFFIX, card_path


class OutputError(ValueError):
    """An output path that cannot be written as asked: the message names it, in one line."""


@dataclass(frozen=True)
class Outputs:
    """The files to write: what ``--out`` and its card name, symlinks inside the folder resolved."""

    checkpoint: Path
    card: Path
    overwrite: bool


def claim(out: Path, *, overwrite: bool) -> Outputs:
    """The checkpoint and card ``out`` names, or ``OutputError`` saying why they cannot be
    written: a folder, a ``.md`` name (its own card), a symlink out of its folder, an existing
    file without ``overwrite``, a name too long, a folder that cannot be created or written."""
    if out.suffix.lower() == CARD_SUFFIX:
        raise OutputError(f"{out} ends in {CARD_SUFFIX}, the card's suffix: the card would be "
                          f"written over the checkpoint")
    try:
        for path in (out, card_path(out)) if out.name else ():
            _fits_names(Path(os.path.realpath(path.parent)), path.name)
        if out.name in ("", ".", "..") or out.is_dir():
            raise OutputError(f"{out} is a folder; name the checkpoint file to write")
        _probe_folder(out.parent)
        checkpoint = _target(out, overwrite)
        card = _target(card_path(out), overwrite)
    except OSError as err:
        raise OutputError(f"{err.filename or out}: {err.strerror or err}") from None
    if checkpoint == card:
        raise OutputError(f"{out}'s card {card_path(out)} is the checkpoint itself")
    return Outputs(checkpoint, card, overwrite)


def _target(path: Path, overwrite: bool) -> Path:
    """The file ``path`` writes: itself, or where its symlink points inside its folder."""
    folder = Path(os.path.realpath(path.parent))
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if target.parent != folder:
            raise OutputError(f"{path} is a symlink to {target}, outside its folder; "
                              f"not followed")
    else:
        target = folder / path.name
    if target.exists() or target.is_symlink():
        mode = os.lstat(target).st_mode
        if stat.S_ISDIR(mode):
            raise OutputError(f"{path} is a folder")
        if not stat.S_ISREG(mode):
            raise OutputError(f"{path} is not a regular file")
        if not overwrite:
            raise OutputError(f"{path} exists; --overwrite replaces it")
    return target


def _fits_names(folder: Path, name: str) -> None:
    """Every name still to be created (folders under the nearest existing one, and the file)
    fits the file system: found now, not as ``ENAMETOOLONG`` after training."""
    base = _existing(folder)
    name_max = os.pathconf(base, "PC_NAME_MAX")
    for part in (*folder.relative_to(base).parts, name):
        if len(os.fsencode(part)) > name_max:
            raise OutputError(f"{part[:40]}...: a name longer than the {name_max} bytes this "
                              f"file system takes")


def _existing(folder: Path) -> Path:
    """``folder`` or its nearest ancestor that exists (the one ``mkdir`` would create under)."""
    while folder != folder.parent:
        try:
            os.stat(folder)
            return folder
        except OSError:  # absent, or a name too long to exist
            folder = folder.parent
    return folder


def _probe_folder(folder: Path) -> None:
    """Creates and removes a temp file where the outputs will go (or in the ancestor their
    folder will be created under): the one reliable test, as root too, that writing works."""
    base = _existing(Path(os.path.realpath(folder)))
    if not base.is_dir():
        raise OutputError(f"{folder}: {base} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(dir=base, prefix=".swa-bench-train.", suffix=".probe")
    except OSError as err:
        raise OutputError(f"{folder}: cannot write there ({err.strerror or err})") from None
    os.close(fd)
    os.unlink(tmp)


def publish(path: Path, write: Callable[[Path], None], *, overwrite: bool) -> None:
    """``write(temp)`` a temp file beside ``path``, sync it and move it to ``path``: replacing
    a file there only with ``overwrite``. Any failure (a full disk, a folder gone read-only) is
    one ``OutputError``; the temp file is removed and ``path`` is as it was."""
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
        _sync_folder(path.parent)
    except OutputError:
        raise
    except Exception as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise OutputError(f"{path}: cannot write ({reason.splitlines()[0] if reason else err!r});"
                          f" left as it was") from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, path: Path) -> None:
    """Moves ``tmp`` to ``path`` unless a file is there (``FileExistsError``, atomically: a hard
    link never replaces); on a file system without hard links, checks and then moves."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputError(f"{path} appeared during training; kept (--overwrite replaces "
                          f"it)") from None
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if path.exists() or path.is_symlink():
            raise OutputError(f"{path} appeared during training; kept (--overwrite replaces "
                              f"it)") from None
        os.replace(tmp, path)


def _sync_folder(folder: Path) -> None:
    """The rename itself survives a power cut once the folder is synced (where that exists)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
