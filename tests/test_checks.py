"""fedmf.checks: each check's accepted values, and refused ones with a one-line message naming the parameter."""

from __future__ import annotations

import io
import math
import pickle

import numpy as np
import pytest
import torch

from fedmf import checks
from fedmf.errors import CheckpointError, ConfigError, ConfigTypeError, FedmfError, PlanMismatch

NOT_NUMBERS = [True, False, np.bool_(True), "1", None, [1.0], 1 + 0j]
NOT_FINITE = [math.nan, math.inf, -math.inf, np.float64("nan"), 10**400]


def _refused(exc, pattern, call, *args, **kwargs):
    with pytest.raises(exc, match=pattern) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, FedmfError) and "\n" not in str(info.value)
    return info.value


def test_error_family():
    assert issubclass(ConfigTypeError, ConfigError) and issubclass(ConfigTypeError, TypeError)
    assert issubclass(FedmfError, ValueError)


@pytest.mark.parametrize("value", [0, 3, -2.5, 1e300, np.float32(0.5), np.int64(7)])
def test_number_accepts_finite_reals(value):
    out = checks.number("clip_norm", value)
    assert type(out) is float and out == float(value)


@pytest.mark.parametrize("value", NOT_NUMBERS)
def test_number_refuses_non_numbers_and_bools(value):
    _refused(ConfigTypeError, r"^clip_norm must be a number, got ", checks.number, "clip_norm", value)


@pytest.mark.parametrize("check", [checks.number, checks.positive, checks.non_negative, checks.probability,
                                   checks.open_unit, lambda name, value: checks.interval(name, value, -1, 1)])
def test_every_float_check_refuses_nan_inf_and_bools(check):
    for value in NOT_FINITE:
        error = _refused(ConfigError, r"^clip_norm must be finite", check, "clip_norm", value)
        assert not isinstance(error, TypeError)
    for value in (True, False):
        _refused(ConfigTypeError, rf"^clip_norm must be a number, got {value}", check, "clip_norm", value)


def test_positive_and_non_negative():
    assert checks.positive("lr", 2) == 2.0 and checks.non_negative("std", 0) == 0.0
    _refused(ConfigError, r"^lr must be positive, got 0", checks.positive, "lr", 0)
    _refused(ConfigError, r"^lr must be positive, got -1", checks.positive, "lr", -1)
    _refused(ConfigError, r"^std must be non-negative, got -0.5", checks.non_negative, "std", -0.5)


def test_integer_in_range():
    assert checks.integer("rounds", 5, minimum=1) == 5
    assert type(checks.integer("rounds", np.int32(5))) is int
    assert checks.integer("shift", -3) == -3 and checks.integer("bands", 4, minimum=1, maximum=4) == 4
    _refused(ConfigError, r"^bands must be an integer in \[1, 4\], got 5", checks.integer, "bands", 5, minimum=1,
             maximum=4)
    _refused(ConfigError, r"^bands must be an integer in \[1, inf\], got 0", checks.integer, "bands", 0, minimum=1)
    _refused(ConfigError, r"^bands must be an integer in \[-inf, 3\], got 4", checks.integer, "bands", 4, maximum=3)
    for value in (True, 2.0, "2", None, math.nan):
        _refused(ConfigTypeError, r"^bands must be an integer, got ", checks.integer, "bands", value)


def test_positive_int():
    assert checks.positive_int("min_sep", 1) == 1 and type(checks.positive_int("min_sep", np.int64(2))) is int
    for value in (0, -1):
        error = _refused(ConfigError, r"^min_sep must be a positive integer, got ", checks.positive_int, "min_sep",
                         value)
        assert not isinstance(error, TypeError)
    for value in (True, 1.0, "1", None):
        _refused(ConfigTypeError, r"^min_sep must be a positive integer, got ", checks.positive_int, "min_sep", value)


def test_probability_and_open_unit():
    assert checks.probability("sampling_probability", 1) == 1.0 and checks.probability("q", 1e-9) == 1e-9
    for value in (0, -0.1, 1.5):
        _refused(ConfigError, r"^q must lie in \(0, 1\], got ", checks.probability, "q", value)
    assert checks.open_unit("delta", 1e-5) == 1e-5
    for value in (0, 1, 2):
        _refused(ConfigError, r"^delta must lie in \(0, 1\), got ", checks.open_unit, "delta", value)


def test_interval():
    assert checks.interval("fraction", 0.5, 0, 0.5) == 0.5 and checks.interval("sigma", 1, 0.05, 5.0) == 1.0
    _refused(ConfigError, r"^fraction must lie in \(0.0, 0.5\], got 0.0$", checks.interval, "fraction", 0.0, 0.0, 0.5,
             low_open=True)
    _refused(ConfigError, r"^sigma must lie in \[0.05, 5.0\), got 5.0$", checks.interval, "sigma", 5.0, 0.05, 5.0,
             high_open=True)
    _refused(ConfigError, r"^sigma must lie in \[0.05, 5.0\], got 0.01$", checks.interval, "sigma", 0.01, 0.05, 5.0)
    assert checks.interval("server-lr", 1e300, 0.0, math.inf, low_open=True) == 1e300
    _refused(ConfigError, r"^server-lr must be > 0.0, got 0$", checks.interval, "server-lr", 0, 0.0, math.inf,
             low_open=True)
    _refused(ConfigError, r"^timeout must be >= 1, got 0.5$", checks.interval, "timeout", 0.5, 1, math.inf)


def test_one_of():
    assert checks.one_of("error", "mean", ("mean", "max")) == "mean"
    _refused(ConfigError, r"^error must be one of 'mean', 'max', got 'min'", checks.one_of, "error", "min",
             ("mean", "max"))
    _refused(ConfigError, r"^flag must be one of 1, 0, got True", checks.one_of, "flag", True, (1, 0))


def test_floating_dtypes_one_list():
    assert checks.floating_dtypes() == (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    assert all(getattr(torch, name).itemsize == size for name, size in checks.FLOATING_DTYPES.items())
    assert checks.is_floating(torch.bfloat16) and not checks.is_floating(torch.int64)
    assert not checks.is_floating(torch.complex64) and not checks.is_floating("float32")


def test_layout():
    assert checks.layout({"w": [2, 3], "b": (np.int64(3),)}) == {"w": (2, 3), "b": (3,)}
    assert checks.layout({"w": torch.Size([4]), "empty": ()}) == {"w": (4,), "empty": ()}
    _refused(ConfigError, r"^layout must be a non-empty mapping", checks.layout, {})
    _refused(ConfigError, r"^layout must be a non-empty mapping", checks.layout, [("w", (2,))])
    _refused(ConfigError, r"^layout names must be strings, got 1", checks.layout, {1: (2,)})
    _refused(ConfigError, r"^layout shape of 'w' must be a tuple of ints", checks.layout, {"w": 3})
    _refused(ConfigError, r"^layout shape of 'w' must be a tuple of ints", checks.layout, {"w": "23"})
    _refused(ConfigError, r"^layout shape of 'w' must be non-negative ints", checks.layout, {"w": (2, -1)})
    _refused(ConfigError, r"^layout shape of 'w' must be non-negative ints", checks.layout, {"w": (True,)})
    _refused(ConfigError, r"^layout shape of 'w' must be non-negative ints", checks.layout, {"w": (2.0,)})
    _refused(ConfigError, r"^layout has no parameters", checks.layout, {"w": (0, 3)})
    _refused(ConfigError, r"^model layout has no parameters", checks.layout, {"w": (0,)}, "model layout")


def test_state_format():
    assert checks.state_format({"format": 1}, "noise state", 1) == 1
    assert checks.state_format({"format": 3}, "noise state", (3, 4)) == 3
    _refused(CheckpointError, r"^noise state must be a mapping, got list", checks.state_format, [], "noise state", 1)
    _refused(CheckpointError, r"^noise state has format 2; this fedmf reads 3 or 4", checks.state_format,
             {"format": 2}, "noise state", (3, 4))
    _refused(CheckpointError, r"^noise state has format None; this fedmf reads 1", checks.state_format, {},
             "noise state", 1)
    _refused(CheckpointError, r"^noise state has format True", checks.state_format, {"format": True}, "noise state", 1)
    _refused(PlanMismatch, r"^plan has format 'x'", checks.state_format, {"format": "x"}, "plan", 1,
             error=PlanMismatch)


class _Secret:
    def __reduce__(self):
        checks.refuse_pickle(self)


class _Saved(_Secret):
    def __reduce__(self):
        checks.refuse_pickle(self, instead="save state_dict()")


def test_refuse_pickle():
    _refused(TypeError, r"^_Secret holds a secret and cannot be pickled$", pickle.dumps, _Secret())
    _refused(TypeError, r"^_Saved holds a secret and cannot be pickled; save state_dict\(\) instead$", pickle.dumps,
             _Saved())


def test_load_tensors_refuses_pickled_objects():
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2), "n": 3}, buffer)
    loaded = checks.load_tensors(io.BytesIO(buffer.getvalue()), "the state")
    assert torch.equal(loaded["w"], torch.ones(2)) and loaded["n"] == 3
    buffer = io.BytesIO()
    torch.save({"obj": _Plain()}, buffer)
    _refused(CheckpointError, r"^cannot read the state: UnpicklingError", checks.load_tensors,
             io.BytesIO(buffer.getvalue()), "the state")
    _refused(ConfigError, r"^cannot read x: ", checks.load_tensors, io.BytesIO(b"junk"), "x", error=ConfigError)


class _Plain:
    pass


def test_engine_errors_name_parameters_not_cli_flags():
    """No ``raise`` in the engine (outside fedmf/cli) names a command-line flag such as ``--bands``."""
    import ast
    import re
    from pathlib import Path

    root = Path(checks.__file__).parent
    flag = re.compile(r"(^|[\s'\"(])--[a-z]")
    found = []
    for path in sorted(root.rglob("*.py")):
        if "cli" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for part in ast.walk(node.exc):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str) and flag.search(part.value):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []


def test_a_schema_given_numpy_ints_stores_plain_ints():
    """MinSep/FixedEpoch keep what positive_int returns: a numpy int would reach the plan's JSON."""
    import json

    import numpy as np

    from fedmf.participation import FixedEpoch, MinSep

    schema = MinSep(np.int64(2), np.int64(3))
    assert type(schema.min_sep) is int and type(schema.max_participations) is int
    assert schema == MinSep(2, 3)
    epoch = FixedEpoch(np.int32(3), np.int32(4))
    assert type(epoch.max_participations) is int and type(epoch.min_sep) is int
    assert json.dumps([schema.min_sep, schema.max_participations]) == "[2, 3]"
