"""Access to the reference values in tests/data/*.json and the comparison rules they state.

The files are part of the repository (their provenance: tests/data/README.md); a missing
file is an error, never a skip."""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parent / "data"


def load_file(name: str) -> dict:
    """The whole reference file ``tests/data/<name>`` (FileNotFoundError when it is missing)."""
    path = REFERENCE_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"reference file {path} is missing (it belongs to the repository: see tests/data/README.md)")
    return json.loads(path.read_text(encoding="utf-8"))


def load_cases(name: str) -> list[dict]:
    return load_file(name)["cases"]


def check(ours: float, case: dict) -> None:
    """Compare as the reference file says: equal / at_most / at_least with relative tol."""
    ref, tol, how = case["value"], case["tol"], case["check"]
    if how == "equal":
        assert abs(ours - ref) <= tol * abs(ref), f"{ours} != {ref} (tol {tol})"
    elif how in ("at_most", "at_most_of_golden"):
        assert ours <= ref * (1 + tol), f"{ours} > {ref} (tol {tol})"
    elif how == "at_least":
        assert ours >= ref * (1 - tol), f"{ours} < {ref} (tol {tol})"
    else:
        raise AssertionError(f"unknown check {how!r}")


def case_id(case: dict) -> str:
    keys = ("kind", "rounds", "max_participations", "min_sep", "num_bands", "gamma", "metric")
    return "-".join(f"{case[k]}" for k in keys if k in case)
