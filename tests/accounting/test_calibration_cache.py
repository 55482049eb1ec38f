"""The calibration kept on disk across processes (fedmf.accounting.disk_cache): a second process
reuses it, and a cached value is used only after it is verified, so a corrupt, foreign or edited
entry (one that would lower the noise among them) is ignored and recomputed."""

from __future__ import annotations

import json
import math
import os

import pytest

from fedmf.accounting import disk_cache, gaussian


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory and an empty in-process cache; counts the real searches."""
    monkeypatch.setenv("FEDMF_CACHE_DIR", str(tmp_path / "cache"))
    gaussian._calibrate_cached.cache_clear()
    searches = []
    real = gaussian._calibrate_search

    def counted(*args):
        searches.append(args)
        return real(*args)

    monkeypatch.setattr(gaussian, "_calibrate_search", counted)
    yield tmp_path / "cache", searches
    gaussian._calibrate_cached.cache_clear()


def _entries(directory):
    return sorted(directory.glob("gaussian-calibrate-*.json")) if directory.is_dir() else []


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_a_new_process_reuses_the_stored_calibration(cache, accountant):
    directory, searches = cache
    z = gaussian.calibrate(4.0, 1e-6, accountant)
    assert len(searches) == 1 and gaussian.meets(z, 4.0, 1e-6, accountant)
    [entry] = _entries(directory)
    assert oct(entry.stat().st_mode & 0o777) == "0o600" and oct(directory.stat().st_mode & 0o777) == "0o700"
    stored = json.loads(entry.read_text())
    assert stored["value"] == z and stored["key"]["epsilon"] == 4.0 and stored["key"]["delta"] == 1e-6
    assert stored["key"]["accountant"] == accountant and stored["key"]["format"] == disk_cache.FORMAT_VERSION
    gaussian._calibrate_cached.cache_clear()  # as a new process
    assert gaussian.calibrate(4.0, 1e-6, accountant) == z and len(searches) == 1
    gaussian._calibrate_cached.cache_clear()
    gaussian.calibrate(4.0, 1e-7, accountant)  # other inputs: another entry, another search
    assert len(searches) == 2 and len(_entries(directory)) == 2


@pytest.mark.parametrize("edit", ["less-noise", "more-noise", "corrupt", "other-key", "nan", "string", "empty"])
def test_an_edited_or_corrupt_entry_is_ignored_and_recomputed(cache, edit):
    directory, searches = cache
    z = gaussian.calibrate(2.0, 1e-5)
    [entry] = _entries(directory)
    stored = json.loads(entry.read_text())
    if edit == "less-noise":
        stored["value"] = z * (1 - 1e-4)  # would break (2, 1e-5)-DP
    elif edit == "more-noise":
        stored["value"] = z * 1.01  # private, but not the calibration
    elif edit == "other-key":
        stored["key"]["epsilon"] = 3.0
    elif edit == "nan":
        stored["value"] = math.nan
    elif edit == "string":
        stored["value"] = str(z)
    text = {"corrupt": '{"key": ', "empty": ""}.get(edit, json.dumps(stored))
    entry.write_text(text)
    gaussian._calibrate_cached.cache_clear()
    assert gaussian.calibrate(2.0, 1e-5) == z and len(searches) == 2
    assert json.loads(entry.read_text())["value"] == z  # the recomputed value replaced it


def test_an_empty_cache_dir_setting_or_an_unwritable_place_only_means_no_disk_cache(cache, tmp_path, monkeypatch):
    directory, searches = cache
    monkeypatch.setenv("FEDMF_CACHE_DIR", "")
    assert disk_cache.cache_dir() is None
    z = gaussian.calibrate(1.0, 1e-6)
    assert not directory.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FEDMF_CACHE_DIR", str(blocker / "cache"))  # below a file: cannot be created
    gaussian._calibrate_cached.cache_clear()
    assert gaussian.calibrate(1.0, 1e-6) == z and len(searches) == 2


def test_the_default_place_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("FEDMF_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_dir() == tmp_path / "xdg" / "fedmf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert disk_cache.cache_dir() == tmp_path / "home" / ".cache" / "fedmf"


def test_the_test_session_never_writes_the_users_cache():
    assert os.environ["FEDMF_CACHE_DIR"] and "pytest" in os.environ["FEDMF_CACHE_DIR"]
