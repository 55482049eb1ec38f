"""The project's own architecture document: the README links it, every module it names exists,
and nothing in the repository points outside it (a user's clone has no ``../shared``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "ARCHITECTURE.md"


def test_the_readme_links_the_architecture_document():
    assert DOC.is_file()
    assert "](ARCHITECTURE.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def _named_paths(text: str) -> list[str]:
    """Backticked names in the document's module table (``where`` column) and its layer sketch."""
    names: list[str] = []
    for row in re.findall(r"^\| (.+?) \|", text, re.M):
        names += re.findall(r"`([\w/.]+)`", row)
    return [n for n in names if n.endswith((".py", "/"))]


def test_every_module_the_document_names_exists():
    text = DOC.read_text(encoding="utf-8")
    names = _named_paths(text)
    assert len(names) >= 20, names  # the table is parsed (a reformatted table must not pass vacuously)
    missing = []
    for name in names:
        candidates = [ROOT / "fedmf" / name, ROOT / "fedmf" / "mechanisms" / name, ROOT / "fedmf" / "ledger" / name,
                      ROOT / name]
        if not any(c.exists() for c in candidates):
            missing.append(name)
    assert not missing, f"ARCHITECTURE.md names modules that do not exist: {missing}"
    for layer in ("launcher/", "server/", "client/", "fedmf/"):
        assert layer in text


def test_nothing_in_the_repository_points_at_shared():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = [f for f in files if f != "tests/docs/test_architecture_doc.py" and (ROOT / f).is_file()
                 and "../shared" in (ROOT / f).read_text(encoding="utf-8", errors="replace")]
    assert not offenders, f"files pointing at ../shared (absent from a user's clone): {offenders}"
