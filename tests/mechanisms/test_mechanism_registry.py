"""The mechanism kinds: their facts are attributes of their classes, one registry lists the classes,
and ``plan`` and ``fedmf mechanism`` read the facts, never a kind's name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import fedmf.mechanisms as mechanisms
from fedmf.errors import ConfigError
from fedmf.mechanisms import BANDED_KINDS, CLOSED_FORM_KINDS, KINDS, OPTIMIZED_KINDS, build, mechanism_class, plan
from fedmf.mechanisms.base import CLOSED_FORM, OPTIMIZED
from fedmf.participation import MinSep

ROOT = Path(__file__).resolve().parents[2]
EVERY_KIND = [entry.kind for entry in mechanisms._REGISTRY]


def test_the_kinds_are_unchanged_and_derived_from_the_classes():
    assert KINDS == ("dp-sgd", "tree", "bsr", "bisr", "bifr", "banded-toeplitz", "banded", "blt", "dense", "robust")
    classes = {kind: mechanism_class(kind) for kind in EVERY_KIND}
    assert all(cls.kind == kind for kind, cls in classes.items())
    assert KINDS == tuple(k for k, cls in classes.items() if cls.made_by is not None)
    assert CLOSED_FORM_KINDS == tuple(k for k, cls in classes.items() if cls.made_by == CLOSED_FORM)
    assert OPTIMIZED_KINDS == tuple(k for k, cls in classes.items() if cls.made_by == OPTIMIZED)
    assert set(BANDED_KINDS) == {k for k, cls in classes.items() if cls.banded and cls.made_by is not None}
    assert set(BANDED_KINDS) == {"bsr", "bisr", "bifr", "banded", "banded-toeplitz", "robust"}
    assert [k for k, cls in classes.items() if cls.made_by is None] == ["banded-inverse-toeplitz"]


@pytest.mark.parametrize("kind", EVERY_KIND)
def test_each_class_reads_only_options_plan_has(kind):
    import inspect

    given = set(inspect.signature(plan).parameters) - {"kind", "rounds", "schema", "workload", "num_bands"}
    assert set(mechanism_class(kind).options) <= given


def test_importing_the_mechanisms_does_not_import_torch():
    code = "import sys, fedmf.mechanisms as m; m.KINDS; m.BANDED_KINDS; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_options_that_do_not_apply_are_refused():
    schema = MinSep(4, 4)
    with pytest.raises(ConfigError, match="num_bands does not apply to tree"):
        plan("tree", 16, schema, num_bands=2)
    with pytest.raises(ConfigError, match="gamma applies to bifr only, not bsr"):
        build("bsr", 16, schema, gamma=0.3)
    with pytest.raises(ConfigError, match="read from a mechanism file"):
        plan("banded-inverse-toeplitz", 16, schema)
    with pytest.raises(ConfigError, match="optimized, not built"):
        build("robust", 16, schema)
    with pytest.raises(ConfigError, match="unknown mechanism kind 'nope'"):
        plan("nope", 16, schema)


@pytest.mark.parametrize("path", ["fedmf/mechanisms/__init__.py", "fedmf/cli/mechanism.py"])
def test_no_branch_on_a_kind_name(path):
    """No comparison with a kind's name: the facts are read from the class."""
    tree = ast.parse((ROOT / path).read_text())
    names = set(EVERY_KIND)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                constants = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                for c in constants:
                    assert not (isinstance(c, ast.Constant) and c.value in names), ast.unparse(node)
