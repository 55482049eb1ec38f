"""Mechanism files (fedmf.mechanisms.io): round trips, schemas, checksums, damage, atomic save."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from fedmf import FixedEpoch, MinSep, Workload
from fedmf.mechanisms import build
from fedmf.mechanisms import io as mio
from fedmf.mechanisms.identity import DpSgd
from fedmf.mechanisms.io import FORMAT, VERSION, MechanismFileError, dumps, load, load_with_schema, loads, save
from fedmf.mechanisms.toeplitz import BandedInverseToeplitz, BandedToeplitz

N = 40
PLANNED = MinSep(10, 4)
WORKLOADS = {
    "prefix": Workload(),
    "momentum": Workload(0.9),
    "cooldown": Workload(0.95, 0.25),
}
_RNG = np.random.default_rng(20240611)
_BT = np.concatenate([[0.7 + abs(_RNG.normal())], _RNG.normal(size=6) / 3])
_BIT = np.concatenate([[0.3 + abs(_RNG.normal())], _RNG.normal(size=5) / 3])

FACTORIES = {
    "dp-sgd": lambda w: build("dp-sgd", N, PLANNED, w),
    "tree": lambda w: build("tree", N, PLANNED, w),
    "bsr": lambda w: build("bsr", N, PLANNED, w),
    "bsr-bands": lambda w: build("bsr", N, PLANNED, w, num_bands=13),
    "bisr": lambda w: build("bisr", N, PLANNED, w),
    "bifr-gamma": lambda w: build("bifr", N, PLANNED, w, gamma=0.3141592653589793),
    "bifr-optimized": lambda w: build("bifr", N, PLANNED, w),
    "banded-toeplitz": lambda w: BandedToeplitz(N, _BT, w),
    "banded-inverse-toeplitz": lambda w: BandedInverseToeplitz(N, _BIT, w),
}


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def assert_bit_identical(a, b, where: str = "params") -> None:
    """Same structure, same types, floats equal bit for bit (so -0.0 != 0.0)."""
    assert type(a) is type(b), (where, a, b)
    if isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), (where, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bit_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_same_evaluation(m1, m2, schema) -> None:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e1, e2 = m1.evaluate(schema), m2.evaluate(schema)
    assert e1.keys() == e2.keys()
    for key in e1:
        if isinstance(e1[key], float):
            assert struct.pack("<d", e1[key]) == struct.pack("<d", e2[key]) or (
                np.isnan(e1[key]) and np.isnan(e2[key])
            ), key
        else:
            assert e1[key] == e2[key], key


def assert_same_mechanism(m1, m2) -> None:
    assert type(m2) is type(m1)
    assert m2.kind == m1.kind
    assert m2.rounds == m1.rounds and type(m2.rounds) is int
    assert m2.workload == m1.workload
    assert_bit_identical(m1.workload.to_dict(), m2.workload.to_dict(), "workload")
    assert_bit_identical(m1.params(), m2.params())
    for attr in ("inverse_toeplitz", "strategy_toeplitz"):
        with np.errstate(all="ignore"):  # arbitrary coefficients may overflow the series inverse
            a, b = getattr(m1, attr), getattr(m2, attr)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.tobytes() == b.tobytes(), attr


def canonical(body) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_doc(path: Path, document: dict, recompute: bool = False) -> Path:
    if recompute:
        document["checksum"] = "sha256:" + hashlib.sha256(canonical(document["body"])).hexdigest()
    path.write_text(json.dumps(document, indent=1))
    return path


@pytest.fixture
def bifr_file(tmp_path) -> Path:
    path = tmp_path / "bifr.json"
    save(build("bifr", N, PLANNED, gamma=0.4321), path, PLANNED)
    return path


# ---------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("workload", list(WORKLOADS), ids=list(WORKLOADS))
@pytest.mark.parametrize("name", list(FACTORIES), ids=list(FACTORIES))
def test_round_trip(tmp_path, name, workload):
    mechanism = FACTORIES[name](WORKLOADS[workload])
    path = tmp_path / "m.json"
    checksum = save(mechanism, path, PLANNED)
    loaded, schema, checksum2 = load_with_schema(path)
    assert checksum2 == checksum
    assert_same_mechanism(mechanism, loaded)
    assert schema == PLANNED
    for s in (PLANNED, MinSep(5), MinSep(N), FixedEpoch(4, 10), FixedEpoch(2, 20)):
        assert_same_evaluation(mechanism, loaded, s)
    assert_same_mechanism(mechanism, load(path))
    # saving the loaded mechanism again gives the same file
    path2 = tmp_path / "again.json"
    assert save(loaded, path2, schema) == checksum
    assert path2.read_text() == path.read_text()


@pytest.mark.parametrize("name", list(FACTORIES), ids=list(FACTORIES))
def test_text_round_trip_is_bit_identical_and_is_the_file(tmp_path, name):
    mechanism = FACTORIES[name](WORKLOADS["cooldown"])
    text = dumps(mechanism, PLANNED, extra={"note": "x"})
    loaded, schema, checksum = loads(text)
    assert_same_mechanism(mechanism, loaded)
    assert schema == PLANNED and checksum == json.loads(text)["checksum"]
    assert dumps(loaded, schema, extra={"note": "x"}) == text  # bit-identical the second time too
    checksum_file = save(mechanism, tmp_path / "m.json", PLANNED, extra={"note": "x"})
    assert (tmp_path / "m.json").read_text() == text and checksum_file == checksum
    assert loads(text.encode())[2] == checksum  # bytes are read as UTF-8
    no_schema = loads(dumps(mechanism))
    assert no_schema[1] is None and no_schema[2] != checksum


def test_text_tampering_is_refused_and_names_its_source():
    text = dumps(build("bifr", N, PLANNED, gamma=0.4321), PLANNED)
    tampered = text.replace("0.4321", "0.4322")
    assert tampered != text
    with pytest.raises(MechanismFileError, match=r"^'ledger run 3' failed its checksum") as info:
        loads(tampered, source="ledger run 3")
    assert "\n" not in str(info.value)
    with pytest.raises(MechanismFileError, match=r"^'<text>' is not a mechanism file \(truncated"):
        loads(text[:-20])
    with pytest.raises(MechanismFileError, match="not UTF-8"):
        loads(b"\xff\xfe" + text.encode())
    with pytest.raises(MechanismFileError, match="not text"):
        loads(None)


def test_bifr_optimized_gamma_is_kept_exactly(tmp_path):
    mechanism = build("bifr", 60, MinSep(12, 5))
    path = tmp_path / "m.json"
    save(mechanism, path, MinSep(12, 5))
    loaded = load(path)
    assert struct.pack("<d", loaded.gamma) == struct.pack("<d", mechanism.gamma)
    assert loaded.num_bands == mechanism.num_bands


_SPECIAL = [-0.0, 0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, -1.7976931348623157e308,
            0.1, 1 / 3, -2 / 3, 1e-300, 123456789.123456789, float(np.nextafter(1.0, 2.0))]


def _arbitrary_floats(seed: int, count: int) -> np.ndarray:
    bits = np.random.default_rng(seed).integers(0, 2**64, size=4 * count, dtype=np.uint64)
    values = bits.view(np.float64)
    return values[np.isfinite(values)][:count]


@pytest.mark.parametrize("cls", [BandedToeplitz, BandedInverseToeplitz])
@pytest.mark.parametrize("seed", range(6))
def test_arbitrary_float_coefficients_bit_identical(tmp_path, cls, seed):
    """Random bit patterns (any finite double, subnormals and -0.0 included) survive the file."""
    values = _arbitrary_floats(seed, 30)
    first = abs(values[0]) or 1.0
    if seed == 0:
        coefficients = np.array([first] + _SPECIAL)
    else:
        coefficients = np.concatenate([[first], values[1 : 2 + seed * 4]])
    mechanism = cls(max(40, coefficients.size), coefficients, WORKLOADS["momentum"] if seed % 2 else Workload())
    path = tmp_path / "m.json"
    save(mechanism, path, MinSep(7, 3))
    loaded, schema, _ = load_with_schema(path)
    assert_same_mechanism(mechanism, loaded)
    key = "coefficients" if cls is BandedToeplitz else "inverse_coefficients"
    assert getattr(loaded, key).tobytes() == coefficients.tobytes()
    assert schema == MinSep(7, 3)


@pytest.mark.parametrize("cls", [BandedToeplitz, BandedInverseToeplitz])
@pytest.mark.parametrize("seed", range(4))
def test_random_coefficients_same_numbers(tmp_path, cls, seed):
    rng = np.random.default_rng(seed)
    coefficients = np.concatenate([[0.1 + rng.exponential()], rng.normal(size=1 + 3 * seed) * 10.0 ** rng.integers(-3, 2)])
    mechanism = cls(48, coefficients, list(WORKLOADS.values())[seed % 3])
    path = tmp_path / "m.json"
    save(mechanism, path)
    loaded, schema, _ = load_with_schema(path)
    assert schema is None
    assert_same_mechanism(mechanism, loaded)
    for s in (MinSep(48), MinSep(6, 8), MinSep(4), MinSep(16, 3), FixedEpoch(6, 8), FixedEpoch(3, 16)):
        assert_same_evaluation(mechanism, loaded, s)


# ---------------------------------------------------------------------------------------
# schemas
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "schema, expected",
    [
        (MinSep(10, 4), MinSep(10, 4)),
        (MinSep(10, 2), MinSep(10, 2)),
        (MinSep(10), MinSep(10, 4)),  # k stored as the participations that fit
        (MinSep(13), MinSep(13, 4)),
        (MinSep(10, 9), MinSep(10, 4)),  # more than fits: stored as what fits
        (MinSep(40), MinSep(40, 1)),
        (MinSep(1, 40), MinSep(1, 40)),
        (FixedEpoch(4, 10), FixedEpoch(4, 10)),
        (FixedEpoch(1, 40), FixedEpoch(1, 40)),
        (FixedEpoch(40, 1), FixedEpoch(40, 1)),
        (None, None),
    ],
    ids=str,
)
def test_schema_round_trip(tmp_path, schema, expected):
    mechanism = build("bisr", N, MinSep(10))
    path = tmp_path / "m.json"
    save(mechanism, path, schema)
    loaded, loaded_schema, _ = load_with_schema(path)
    assert loaded_schema == expected
    if schema is not None:
        assert type(loaded_schema) is type(schema)
        assert loaded_schema.min_sep == schema.min_sep
        assert loaded_schema.participations(N) == schema.participations(N)
        assert loaded.evaluate(loaded_schema) == mechanism.evaluate(schema)


# ---------------------------------------------------------------------------------------
# checksums
# ---------------------------------------------------------------------------------------
def test_checksum_returned_equals_file(tmp_path):
    mechanism = FACTORIES["banded-toeplitz"](Workload(0.9))
    path = tmp_path / "m.json"
    checksum = save(mechanism, path, PLANNED)
    document = json.loads(path.read_text())
    assert document["format"] == FORMAT == "fedmf-mechanism"
    assert document["version"] == VERSION == 1
    assert checksum == document["checksum"]
    assert checksum == "sha256:" + hashlib.sha256(canonical(document["body"])).hexdigest()
    assert load_with_schema(path)[2] == checksum
    body = document["body"]
    assert body["kind"] == "banded-toeplitz" and body["rounds"] == N
    assert body["schema"] == {"type": "min-sep", "min_sep": 10, "max_participations": 4}


def test_checksum_ignores_formatting_only(tmp_path, bifr_file):
    """Re-indenting or reordering keys does not change the meaning: the file still loads."""
    document = json.loads(bifr_file.read_text())
    reordered = {"body": dict(reversed(list(document["body"].items()))), "checksum": document["checksum"],
                 "version": document["version"], "format": document["format"]}
    path = tmp_path / "reformatted.json"
    path.write_text(json.dumps(reordered, indent=4))
    assert_same_mechanism(load(bifr_file), load(path))
    path.write_text(json.dumps(document, separators=(",", ":")))
    assert_same_mechanism(load(bifr_file), load(path))


def test_different_mechanisms_different_checksums(tmp_path):
    a = save(build("bisr", N, PLANNED), tmp_path / "a.json", PLANNED)
    b = save(build("bisr", N, PLANNED, num_bands=9), tmp_path / "b.json", PLANNED)
    c = save(build("bisr", N, PLANNED), tmp_path / "c.json", MinSep(10, 3))
    assert len({a, b, c}) == 3


def test_extra_is_covered_by_checksum(tmp_path):
    path = tmp_path / "m.json"
    save(build("bsr", N, PLANNED), path, PLANNED, extra={"note": "run 7"})
    assert json.loads(path.read_text())["body"]["extra"] == {"note": "run 7"}
    load(path)
    path.write_text(path.read_text().replace("run 7", "run 8"))
    with pytest.raises(MechanismFileError, match="checksum"):
        load(path)


def _mutate(c: str) -> str:
    if c.isdigit():
        return str((int(c) + 1) % 10)
    if c.isalpha():
        base = ord("a") if c.islower() else ord("A")
        return chr(base + (ord(c) - base + 1) % 26)
    return "x"


@pytest.mark.parametrize("name", ["bifr-gamma", "banded-toeplitz", "tree", "bifr-optimized"])
def test_tampering_any_byte_of_the_body(tmp_path, name):
    """Change each character of the body in turn (checksum kept): whatever changes the
    body's meaning is refused with a checksum error; what breaks the JSON is refused too."""
    path = tmp_path / "m.json"
    save(FACTORIES[name](Workload(0.9)), path, PLANNED, extra={"note": "a b"})
    text = path.read_text()
    original = json.loads(text)
    start = text.index('"body":') + len('"body":')
    end = text.rindex("}")  # the document's closing brace
    target = tmp_path / "tampered.json"
    refused = 0
    for i in range(start, end):
        mutated = text[:i] + _mutate(text[i]) + text[i + 1 :]
        target.write_text(mutated)
        try:
            parsed = json.loads(mutated)
        except json.JSONDecodeError:
            with pytest.raises(MechanismFileError):
                load(target)
            refused += 1
            continue
        if canonical(parsed["body"]) == canonical(original["body"]):
            load(target)  # formatting only, e.g. an equivalent float spelling
            continue
        with pytest.raises(MechanismFileError, match="checksum") as info:
            load(target)
        assert isinstance(info.value, ValueError)
        refused += 1
    assert refused >= (end - start) * 0.5


@pytest.mark.parametrize(
    "edit",
    ["rounds", "gamma-digit", "bands", "momentum", "schema-min-sep", "schema-k", "kind", "checksum-digit",
     "created-by", "drop-schema"],
)
def test_tampered_fields_keep_checksum(tmp_path, bifr_file, edit):
    document = json.loads(bifr_file.read_text())
    body = document["body"]
    if edit == "rounds":
        body["rounds"] = 41
    elif edit == "gamma-digit":
        assert body["params"]["gamma"] == 0.4321
        body["params"]["gamma"] = 0.4322
    elif edit == "bands":
        body["params"]["num_bands"] += 1
    elif edit == "momentum":
        body["workload"]["momentum"] = 0.5
    elif edit == "schema-min-sep":
        body["schema"]["min_sep"] = 20
    elif edit == "schema-k":
        body["schema"]["max_participations"] = 1
    elif edit == "kind":
        body["kind"] = "bisr"
    elif edit == "checksum-digit":
        c = document["checksum"]
        document["checksum"] = c[:-1] + _mutate(c[-1])
    elif edit == "created-by":
        body["created_by"] = "someone else"
    elif edit == "drop-schema":
        del body["schema"]
    path = write_doc(tmp_path / "t.json", document)
    with pytest.raises(MechanismFileError, match="checksum"):
        load_with_schema(path)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_tampered_non_finite_literal(tmp_path, bifr_file, literal):
    text = bifr_file.read_text()
    assert "0.4321" in text
    path = tmp_path / "t.json"
    path.write_text(text.replace("0.4321", literal))
    with pytest.raises(MechanismFileError, match="checksum|not a"):
        load(path)


# ---------------------------------------------------------------------------------------
# truncated, unreadable, other formats, versions
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bifr-gamma", "banded-inverse-toeplitz"])
def test_truncated_everywhere(tmp_path, name):
    path = tmp_path / "m.json"
    save(FACTORIES[name](Workload()), path, PLANNED)
    text = path.read_text()
    end = len(text.rstrip())
    target = tmp_path / "cut.json"
    for cut in [len(text) // 2] + list(range(0, end)):
        target.write_text(text[:cut])
        with pytest.raises(MechanismFileError, match="truncated|not a") as info:
            load(target)
        assert str(target) in str(info.value)
    target.write_bytes(path.read_bytes()[: len(text) // 2])
    with pytest.raises(MechanismFileError, match="truncated"):
        load(target)


def test_missing_file(tmp_path):
    with pytest.raises(MechanismFileError, match="cannot read") as info:
        load(tmp_path / "nope.json")
    assert "nope.json" in str(info.value)
    with pytest.raises(MechanismFileError):
        load(tmp_path)  # a directory


@pytest.mark.parametrize("text", ["", "   \n", "hello", "{", "{\"format\": ", "<html></html>"], ids=repr)
def test_not_json(tmp_path, text):
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(MechanismFileError, match="not a mechanism file"):
        load(path)


def test_binary_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_bytes(b"\xff\xfe\x00garbage" + bytes(range(256)))
    with pytest.raises(MechanismFileError, match="not a"):
        load(path)


@pytest.mark.parametrize(
    "document",
    [
        {"format": "something-else", "version": 1, "checksum": "sha256:00", "body": {}},
        {"hello": "world"},
        [1, 2, 3],
        "fedmf-mechanism",
        None,
        42,
        {"version": 1, "body": {}},
        {"format": "FEDMF-MECHANISM", "version": 1},
    ],
    ids=["other-format", "object", "list", "string", "null", "number", "no-format", "wrong-case"],
)
def test_other_json_formats(tmp_path, document):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(document))
    with pytest.raises(MechanismFileError, match="not a fedmf mechanism file"):
        load(path)


@pytest.mark.parametrize("version", [2, 0, "1", None, 1.5])
@pytest.mark.parametrize("recompute", [False, True], ids=["checksum-kept", "checksum-recomputed"])
def test_version_mismatch(tmp_path, bifr_file, version, recompute):
    document = json.loads(bifr_file.read_text())
    if version is None:
        del document["version"]
    else:
        document["version"] = version
    path = write_doc(tmp_path / "v.json", document, recompute=recompute)
    with pytest.raises(MechanismFileError, match="version") as info:
        load(path)
    assert repr(version) in str(info.value)
    assert str(VERSION) in str(info.value)


def test_missing_or_bad_body(tmp_path, bifr_file):
    document = json.loads(bifr_file.read_text())
    for body in (None, [], "x"):
        document["body"] = body
        with pytest.raises(MechanismFileError, match="checksum"):
            load(write_doc(tmp_path / "b.json", document))
    del document["body"]
    with pytest.raises(MechanismFileError, match="checksum"):
        load(write_doc(tmp_path / "b.json", document))


# ---- valid checksum (recomputed), invalid content -------------------------------------
def _edit(document: dict, case: str) -> dict:
    body = document["body"]
    if case == "bands-gt-rounds":
        body["params"]["num_bands"] = 1000
    elif case == "bands-zero":
        body["params"]["num_bands"] = 0
    elif case == "gamma-out-of-range":
        body["params"]["gamma"] = 1.5
    elif case == "unknown-kind":
        body["kind"] = "nope"
    elif case == "rounds-zero":
        body["rounds"] = 0
    elif case == "rounds-negative":
        body["rounds"] = -3
    elif case == "rounds-word":
        body["rounds"] = "forty"
    elif case == "momentum":
        body["workload"]["momentum"] = 2.0
    elif case == "schema-type":
        body["schema"]["type"] = "zzz"
    elif case == "schema-k-float":
        body["schema"]["max_participations"] = 2.5
    elif case == "params-list":
        body["params"] = [1]
    elif case == "params-missing":
        del body["params"]["num_bands"]
    elif case == "workload-missing":
        del body["workload"]
    elif case == "rounds-fraction":
        body["rounds"] = 40.5
    elif case == "bands-fraction":
        body["params"]["num_bands"] = 9.9
    elif case == "dpsgd-rounds-zero":
        body["kind"], body["params"], body["rounds"] = "dp-sgd", {}, 0
    elif case == "dpsgd-rounds-negative":
        body["kind"], body["params"], body["rounds"] = "dp-sgd", {}, -4
    elif case == "schema-b-gt-rounds":
        body["schema"]["min_sep"] = 1000
    else:
        raise AssertionError(case)
    return document


INVALID_OK = ["bands-gt-rounds", "bands-zero", "gamma-out-of-range", "unknown-kind", "rounds-zero", "rounds-negative",
              "rounds-word", "momentum", "schema-type", "schema-k-float", "params-list", "params-missing",
              "workload-missing"]


@pytest.mark.parametrize("case", INVALID_OK)
def test_invalid_content_with_valid_checksum(tmp_path, bifr_file, case):
    document = _edit(json.loads(bifr_file.read_text()), case)
    path = write_doc(tmp_path / "i.json", document, recompute=True)
    with pytest.raises(MechanismFileError, match="invalid"):
        load_with_schema(path)


@pytest.mark.parametrize(
    "case, why",
    [
        pytest.param("rounds-fraction", "rounds 40.5 is silently truncated by int() to 40", id="rounds-fraction"),
        pytest.param("bands-fraction", "num_bands 9.9 is silently truncated by int() to 9 (a different mechanism "
                     "loads)", id="bands-fraction"),
        pytest.param("dpsgd-rounds-zero", "DpSgd has no __post_init__ validation, so DpSgd(rounds=0) loads",
                     id="dpsgd-rounds-zero"),
        pytest.param("dpsgd-rounds-negative", "DpSgd(rounds=-4) loads (no validation in DpSgd)",
                     id="dpsgd-rounds-negative"),
        pytest.param("schema-b-gt-rounds", "the planned schema is not validated against the rounds "
                     "(min_sep 1000 > n 40 loads)", id="schema-b-gt-rounds"),
    ],
)
def test_invalid_content_with_valid_checksum_refused(tmp_path, bifr_file, case, why):
    document = _edit(json.loads(bifr_file.read_text()), case)
    path = write_doc(tmp_path / "i.json", document, recompute=True)
    with pytest.raises(MechanismFileError, match="invalid"):
        load_with_schema(path)


def test_error_is_value_error():
    assert issubclass(MechanismFileError, ValueError)


# ---------------------------------------------------------------------------------------
# atomic save
# ---------------------------------------------------------------------------------------
def _nan_params(monkeypatch):
    monkeypatch.setattr(DpSgd, "params", lambda self: {"scale": float("nan")})


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_save_nan_params_leaves_nothing(tmp_path, monkeypatch, existing):
    target = tmp_path / "m.json"
    if existing:
        save(build("bisr", N, PLANNED), target, PLANNED)
    before = target.read_bytes() if existing else None
    _nan_params(monkeypatch)
    with pytest.raises(ValueError):
        save(DpSgd(N), target, PLANNED)
    if existing:
        assert target.read_bytes() == before
        assert os.listdir(tmp_path) == ["m.json"]
    else:
        assert not target.exists()
        assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["enospc", "interrupt"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_save_failing_mid_write_leaves_nothing(tmp_path, monkeypatch, existing, exc):
    target = tmp_path / "m.json"
    if existing:
        save(build("bisr", N, PLANNED), target, PLANNED)
    before = target.read_bytes() if existing else None
    real_atomic_write = mio.atomic_write

    class Failing:  # a file that takes part of the document, then fails
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[:50])
            self.f.flush()
            raise exc

    def atomic_write(path, write, *, text):
        real_atomic_write(path, lambda f: write(Failing(f)), text=text)

    monkeypatch.setattr(mio, "atomic_write", atomic_write)
    with pytest.raises(type(exc)):
        save(build("bsr", N, PLANNED), target, PLANNED)
    monkeypatch.setattr(mio, "atomic_write", real_atomic_write)
    assert os.listdir(tmp_path) == (["m.json"] if existing else [])
    if existing:
        assert target.read_bytes() == before
        load(target)


def test_save_failing_rename_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "m.json"

    def replace(src, dst):
        raise OSError(errno.EXDEV, "rename failed")

    monkeypatch.setattr(mio.os, "replace", replace)
    with pytest.raises(OSError):
        save(build("bsr", N, PLANNED), target, PLANNED)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_save_overwrites_and_leaves_no_temp(tmp_path):
    target = tmp_path / "m.json"
    first = save(build("bsr", N, PLANNED), target, PLANNED)
    second = save(build("bisr", N, PLANNED), target, PLANNED)
    assert first != second
    assert os.listdir(tmp_path) == ["m.json"]
    assert load(target).kind == "bisr"


def test_save_relative_path_and_str(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checksum = save(build("tree", N, PLANNED), "m.json", PLANNED)
    assert os.listdir(tmp_path) == ["m.json"]
    assert load("m.json").kind == "tree"
    assert load_with_schema(str(tmp_path / "m.json"))[2] == checksum
