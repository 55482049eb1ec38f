"""A refused start leaves nothing behind: what a start created in the run directory (and the
directories it made on the way) is removed when the run lock or a check refuses it, never what was
there before, and never the state of a run that already began from its noise seed."""

from __future__ import annotations

from pathlib import Path

__all__ = ["RUN_FILE", "entries", "missing_dirs", "remove_created"]

#: the run directory's record of its run (written once a run began: a start that wrote it is not undone)
RUN_FILE = "run.json"


def entries(directory: Path) -> set[str] | None:
    """The names in ``directory`` and in its ``secrets/`` (None: no directory)."""
    if not directory.is_dir():
        return None
    names = {p.name for p in directory.iterdir()}
    secrets = directory / "secrets"
    if secrets.is_dir():
        names |= {f"secrets/{p.name}" for p in secrets.iterdir()}
    return names


def missing_dirs(directory: Path) -> set[Path]:
    """``directory`` and those of its parents that do not exist yet (what a ``mkdir -p`` makes)."""
    out, path = set(), directory.absolute()
    while not path.exists() and path != path.parent:
        out.add(path)
        path = path.parent
    return out


def remove_created(directory: Path, existed: set[str] | None, made: set[Path] = frozenset()) -> None:
    """After a refused start (the run lock held): remove the files and directories this start created
    in ``directory`` that ``existed`` did not list (the directory too, if it created it), unless a new
    run was already started from its noise seed (``noise_seed.used``: that state must stay, and a
    retry is refused with the way out). ``made``: the directories (``missing_dirs``) that did not exist
    before; the empty ones are removed. Nothing that was there before is touched."""
    try:
        now = entries(directory) or set()
        before = existed or set()
        created = now - before
        if "secrets/noise_seed.used" in created or RUN_FILE in created:
            return
        for name in sorted(created, key=lambda n: -n.count("/")):  # files in secrets/ before secrets/
            path = directory / name
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            else:
                path.unlink(missing_ok=True)
        if existed is None:  # this start made the directory, and any missing parent of it: empty ones go
            start = directory.absolute()
            for path in (start, *start.parents):
                if path not in made or not path.is_dir() or any(path.iterdir()):
                    break
                path.rmdir()
    except OSError:
        pass  # best effort: the refusal itself is the error to report
