"""Access to ../shared/reference/*.json and the comparison rules they state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REFERENCE_DIR = Path(os.environ.get("FEDMF_REFERENCE_DIR", Path(__file__).resolve().parents[2] / "shared" / "reference"))


def load_cases(name: str) -> list[dict]:
    path = REFERENCE_DIR / name
    if not path.exists():
        if os.environ.get("CI") == "true":
            raise FileNotFoundError(f"reference file {path} is missing")
        pytest.skip(f"reference file {path} not found", allow_module_level=True)
    return json.loads(path.read_text())["cases"]


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
