"""Writing all artifacts of a plan at once, validated first and never half-written."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from dsauto.emit import parser_process
from dsauto.emit.ds_config import Target, ds_config, write_ds_config
from dsauto.emit.megatron import write_megatron_args
from dsauto.emit.plot import plot_plan
from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.plan_io import (
    DS_CONFIG_NAME,
    MEGATRON_ARGS_NAME,
    PLAN_YAML_NAME,
    write_plan_yaml,
)

PLAN_PNG_NAME = "plan.png"
STAGING_PREFIX = ".dsauto-staging-"
"""Folders in ``out_dir`` where a set is written before it is renamed into place; named after the
writing process (``.dsauto-staging-<pid>-...``), so that the next writer removes those of dead ones."""
LOCK_NAME = ".dsauto.lock"


def write_artifacts(plan: Plan, out_dir: Path | str, target: Target = "deepspeed") -> list[Path]:
    """Writes ``ds_config.json`` (for ``target``: ``deepspeed`` or Hugging Face's ``hf`` convention),
    ``megatron_args.txt``, ``plan.yaml`` and the picture ``plan.png`` of ``plan`` into ``out_dir``.

    The files are written into a staging folder inside ``out_dir`` and renamed into place only once
    DeepSpeed's parser has taken the config (:func:`write_staged`), so that an error leaves
    ``out_dir`` as it was, and each file in it is either the old one or the complete new one; every
    file but the picture carries the plan's id, so that readers refuse a set cut off between two
    renames. Where :func:`~dsauto.emit.parser_process.start_parser` was called (``dsauto tune`` calls
    it before its search), the parser runs in a process of its own, which imported DeepSpeed while
    the plan was searched, the files written and the picture drawn. ``out_dir`` is created if
    needed; other files in it are left alone. Returns the paths written, in the order above.
    """

    def write(staging: Path) -> list[Path]:
        written = [
            write_ds_config(plan, staging / DS_CONFIG_NAME, target),
            write_megatron_args(plan, staging / MEGATRON_ARGS_NAME),
            write_plan_yaml(plan, staging / PLAN_YAML_NAME),
            plot_plan(plan, staging / PLAN_PNG_NAME),
        ]
        parser_process.validate(ds_config(plan, target), plan.dp)
        return written

    return write_staged(Path(out_dir), write)


def write_staged(out_dir: Path, write: Callable[[Path], list[Path]]) -> list[Path]:
    """Runs ``write`` into a staging folder inside ``out_dir`` (the same file system, even when
    ``out_dir`` is a mount point), then renames each file it wrote into ``out_dir``: an error leaves
    ``out_dir`` as it was (and removes it again if this call created it), and each file there is
    either the old one or the complete new one; a folder where a file goes is refused before any
    rename. Staging folders left by writers that were killed
    are removed first. A folder that cannot be written is a DsautoError naming it."""
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    staging: Path | None = None
    try:
        with _folder_errors(out_dir):
            check_writable_folder(out_dir, "--out")
            out_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_staging(out_dir)
            staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=out_dir))
        staged = write(staging)  # its own errors (a full disk) propagate as they are
        written = []
        for path in staged:  # a folder in a file's place would stop the renames halfway
            if (out_dir / path.name).is_dir():
                raise DsautoError(f"{out_dir / path.name} is a folder where dsauto writes its {path.name}; move it "
                                  f"or choose another --out (nothing was written).")
        with _folder_errors(out_dir):
            for path in staged:
                target = out_dir / path.name
                os.replace(path, target)  # atomic on one file system: never a partial file at target
                written.append(target)
        return written
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # nothing was written: leave no empty folder behind


@contextlib.contextmanager
def _folder_errors(out_dir: Path) -> Iterator[None]:
    """The folder's own failures (read-only, immutable, gone) as one sentence naming it."""
    try:
        yield
    except OSError as exc:
        raise DsautoError(f"Cannot write the artifacts into {out_dir}: {exc.strerror or exc}; choose a "
                          f"writable --out folder.") from None


def check_writable_folder(folder: Path | str, option: str) -> None:
    """Raises DsautoError when ``folder`` cannot become a folder dsauto writes into: an empty name,
    an existing file, or a place this user cannot write (checked before any work is done)."""
    text = os.fspath(folder)
    if not text.strip():
        raise DsautoError(f"{option} is empty; give the folder to write into, e.g. {option} out.")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise DsautoError(f"{option} {path} is an existing file, not a folder; give a folder (it is "
                          f"created if needed).")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise DsautoError(f"{option} {path} cannot be created: {existing} is a file; give a folder.")
    try:  # a file made and removed: the one test that sees read-only mounts and immutable folders
        probe, name = tempfile.mkstemp(prefix=".dsauto-probe-", dir=existing)
        os.close(probe)
        os.unlink(name)
    except OSError as exc:
        what = "is not writable" if existing == path else f"cannot be created in {existing}, which is not writable"
        raise DsautoError(f"{option} {path} {what} ({exc.strerror or exc}); choose another folder.") from None


def remove_stale_staging(out_dir: Path) -> None:
    """Removes staging folders in ``out_dir`` whose writer is gone (a run killed while writing), and
    those older dsauto versions left beside it (``.<name>-dsauto-*``)."""
    stale = [p for p in out_dir.glob(f"{STAGING_PREFIX}*") if not _writer_alive(p)]
    stale += list(out_dir.parent.glob(f".{out_dir.name}-dsauto-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


def _writer_alive(staging: Path) -> bool:
    pid = staging.name[len(STAGING_PREFIX):].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def folder_lock(folder: Path | str, what: str, wait: bool = False, name: str = LOCK_NAME) -> Iterator[None]:
    """Holds an exclusive lock on ``folder`` for the ``with`` block (a ``.dsauto.lock`` file in it,
    removed at the end), so that two dsauto processes never write into one folder at once. Without
    ``wait``, a lock held by another process is a DsautoError naming its pid (``what`` says what the
    folder is for); with ``wait``, this process waits for it. The kernel releases the lock of a
    process that dies, so a killed run never leaves the folder locked. A lock of another purpose on
    the same folder takes another file ``name``, so that the two never wait on each other."""
    import fcntl

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    while True:
        file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - closed below, or kept while locked
        try:
            fcntl.flock(file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise DsautoError(f"Another dsauto process (pid {holder}) is using {folder} as {what}; wait "
                              f"for it to finish, or give another folder.") from None
        except OSError:
            pass  # a file system without locks (some network mounts): go on unlocked
        try:
            same = os.fstat(file.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        file.close()  # the holder removed the file as this process locked it: lock the new one
    try:
        file.seek(0)
        file.truncate()
        file.write(str(os.getpid()))
        file.flush()
        yield
    finally:
        path.unlink(missing_ok=True)  # still holding the lock: nobody can have locked this file
        file.close()
