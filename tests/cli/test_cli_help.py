"""Every option of every ``fedmf`` sub-command has a description, and ``fedmf simulate --help``
states each preset's cost (from ``fedmf.run.simulate.PRESET_COST``, next to the presets)."""

from __future__ import annotations

import argparse

import pytest

from fedmf.cli import build_parser, main
from fedmf.run.simulate import PRESET_COST, PRESETS


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, path + (name,))


def _commands():
    return list(_walk(build_parser()))


def test_the_walk_reaches_every_command():
    names = {" ".join(path) for path, _ in _commands()}
    # the leaves a user types; the walk must not stop at the first level
    for expected in ("simulate", "mechanism", "evaluate", "audit", "budget set", "budget show", "budget default",
                     "user enroll", "calibrate", "epsilon"):
        assert any(n == expected or n.startswith(expected + " ") for n in names), (expected, sorted(names))


@pytest.mark.parametrize("path,parser", _commands(), ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_option_has_help(path, parser):
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and (a.help is None or not a.help.strip() or a.help == argparse.SUPPRESS)]
    assert not missing, f"fedmf {' '.join(path)}: options without help: {missing}"


def test_simulate_help_states_every_presets_cost(capsys):
    assert set(PRESET_COST) == set(PRESETS)  # one table: a new preset must state its cost
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, cost in PRESET_COST.items():
        assert f"{name}: {' '.join(cost.split())}" in text, name
