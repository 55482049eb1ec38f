"""StackOverflow next-word prediction: the real TFF file (``stackoverflow``) and a generated
look-alike (``so-synthetic``). Both go through :mod:`fedmf.tasks.text` (TFF's ids, 20 words, BOS,
EOS, pad) and train the LSTM of :mod:`fedmf.tasks.models`.

``stackoverflow`` — options (defaults): ``path`` (required: TFF's ``stackoverflow.sqlite``),
``vocab_path`` (required: ``stackoverflow.word_count``), ``vocab_size`` 10,000, ``max_sentences``
256, ``eval_split`` "heldout" ("heldout" | "test"), ``eval_sentences`` 10,000, ``model_size``
"paper", ``seed`` 0 (model initialization and local shuffles).

* The file is opened read-only; tables ``examples(split_name, client_id, serialized_example_proto)``
  and ``client_metadata(client_id, split_name, num_examples)`` are checked on construction.
  ``users()`` = the train split's client ids from ``client_metadata``, sorted as strings.
* A user's sentences: their train examples in file (rowid) order, the first ``max_sentences``.
  TFF does the same (``dataset.take(max_elements_per_client)`` before its shuffle, on the rows in
  the order SQLite returns them, which is rowid order for one client's rows); our local SGD then
  shuffles them per (user, round) from ``stable_seed``.
* Each example is a serialized ``tf.train.Example`` parsed with a message class declared at run
  time in a private protobuf descriptor pool (no TensorFlow, nothing registered globally); the
  bytes feature ``tokens`` is split on single spaces exactly like ``tf.strings.split(sep=' ')``
  (= Python's ``str.split(' ')``: an empty sentence is one empty word, i.e. one OOV, and a double
  space makes an empty word, OOV too).
* ``evaluate``: the ``eval_split`` clients in sorted id order, up to ``max_sentences`` each, until
  ``eval_sentences`` sentences (spread over ≥ eval_sentences / max_sentences users; TFF's
  centralized validation instead takes the first 10,000 examples of the pooled split).
  Per-client reads use ``WHERE client_id = ?``: fast on the real file only with its index.

``so-synthetic`` — generated, deterministic from ``seed``, one user at a time (never all users);
see :class:`SyntheticStackOverflowTask` for the model of the data and its assumptions.
"""

from __future__ import annotations

import functools
import math
import os
import sqlite3
import statistics
import threading
import urllib.parse
from typing import Any

import numpy as np
import torch

from .. import checks
from ..errors import ConfigError
from .base import check_options, stable_seed
from .text import LRU, TextTask, Vocab, common_options, frame, read_word_counts, to_xy

__all__ = ["StackOverflowTask", "SyntheticStackOverflowTask", "example_class", "parse_tokens",
           "SPLITS", "PUNCTUATION"]

SPLITS = ("train", "heldout", "test")
_CACHE_USERS = 512


@functools.lru_cache(maxsize=1)
def example_class() -> type:
    """``tensorflow.Example`` (with Features, Feature, BytesList, FloatList, Int64List) as a
    message class built at run time in a private descriptor pool, wire-compatible with
    tensorflow/core/example/{example,feature}.proto."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="fedmf/tf_example.proto", package="tensorflow", syntax="proto3")

    def message(name: str, fields: list[tuple[str, int, int, int, str]], parent: Any = None) -> Any:
        m = (parent.nested_type if parent is not None else file.message_type).add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
        return m

    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", [("value", 1, F.TYPE_BYTES, rep, "")])
    floats = message("FloatList", [("value", 1, F.TYPE_FLOAT, rep, "")])
    floats.field[0].options.packed = True
    ints = message("Int64List", [("value", 1, F.TYPE_INT64, rep, "")])
    ints.field[0].options.packed = True
    feature = message("Feature", [("bytes_list", 1, F.TYPE_MESSAGE, opt, ".tensorflow.BytesList"),
                                  ("float_list", 2, F.TYPE_MESSAGE, opt, ".tensorflow.FloatList"),
                                  ("int64_list", 3, F.TYPE_MESSAGE, opt, ".tensorflow.Int64List")])
    feature.oneof_decl.add(name="kind")
    for f in feature.field:
        f.oneof_index = 0
    features = message("Features", [("feature", 1, F.TYPE_MESSAGE, rep, ".tensorflow.Features.FeatureEntry")])
    entry = message("FeatureEntry", [("key", 1, F.TYPE_STRING, opt, ""),
                                     ("value", 2, F.TYPE_MESSAGE, opt, ".tensorflow.Feature")], parent=features)
    entry.options.map_entry = True
    message("Example", [("features", 1, F.TYPE_MESSAGE, opt, ".tensorflow.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


def parse_tokens(blob: bytes, where: str = "example") -> str:
    """The ``tokens`` sentence of one serialized tf.train.Example; ConfigError if it has none."""
    from google.protobuf.message import DecodeError

    try:
        example = example_class().FromString(bytes(blob))
    except (DecodeError, TypeError):
        raise ConfigError(f"{where} is not a serialized tf.train.Example") from None
    features = example.features.feature
    if "tokens" not in features or features["tokens"].WhichOneof("kind") != "bytes_list" \
            or len(features["tokens"].bytes_list.value) != 1:
        raise ConfigError(f"{where} has no single-value bytes feature 'tokens'")
    return features["tokens"].bytes_list.value[0].decode("utf-8", errors="replace")


_REQUIRED = {"examples": {"split_name", "client_id", "serialized_example_proto"},
             "client_metadata": {"client_id", "split_name", "num_examples"}}

_SO_DEFAULTS: dict[str, Any] = {"path": None, "vocab_path": None, "vocab_size": 10_000, "max_sentences": 256,
                                "eval_split": "heldout", "eval_sentences": 10_000, "model_size": "paper", "seed": 0}


class StackOverflowTask(TextTask):
    """TFF's StackOverflow file, read lazily one user at a time; see the module docstring."""

    name = "stackoverflow"

    @classmethod
    def _validate(cls, options: dict[str, Any]) -> dict[str, Any]:
        out = common_options("stackoverflow", check_options("stackoverflow", options, _SO_DEFAULTS))
        for key, what in (("path", "stackoverflow.sqlite"), ("vocab_path", "stackoverflow.word_count")):
            value = out[key]
            if not isinstance(value, str) or not value:
                raise ConfigError(f"stackoverflow {key} must be the path of TFF's {what}, got {value!r}")
            if not os.path.isfile(value):
                raise ConfigError(f"stackoverflow {key} {value!r} is not a file")
        if out["eval_split"] not in ("heldout", "test"):
            raise ConfigError(f"stackoverflow eval_split must be 'heldout' or 'test', got {out['eval_split']!r}")
        out["eval_sentences"] = checks.integer("stackoverflow eval_sentences", out["eval_sentences"],
                                               minimum=1, maximum=10_000_000)
        return out

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.vocab = Vocab(read_word_counts(self.options["vocab_path"], self.vocab_size), self.vocab_size)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._check_schema()
        self._users: list[str] | None = None
        self._user_set: frozenset[str] | None = None
        self._cache = LRU(_CACHE_USERS)
        self._heldout: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:  # a connection and a lock do not pickle
        state = dict(self.__dict__)
        state.update(_conn=None, _lock=None, _cache=LRU(_CACHE_USERS))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        path = self.options["path"]
        with self._lock:
            try:
                if self._conn is None:
                    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
                    self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise ConfigError(f"stackoverflow path {path!r}: {str(e).splitlines()[0]}") from None

    def _check_schema(self) -> None:
        for table, columns in _REQUIRED.items():
            have = {row[1] for row in self._query(f"PRAGMA table_info({table})")}
            if not have:
                raise ConfigError(f"stackoverflow path {self.options['path']!r} has no table {table!r}")
            if not columns <= have:
                raise ConfigError(f"stackoverflow table {table!r} lacks column(s) {sorted(columns - have)}")

    def clients(self, split: str) -> list[str]:
        """The client ids of ``split`` (from client_metadata), sorted as strings."""
        if split not in SPLITS:
            raise ConfigError(f"stackoverflow split must be one of {SPLITS}, got {split!r}")
        rows = self._query("SELECT DISTINCT client_id FROM client_metadata WHERE split_name = ?", (split,))
        return sorted(str(r[0]) for r in rows)

    def users(self) -> list[str]:
        if self._users is None:
            users = self.clients("train")
            self._user_set = frozenset(users)  # before _users: parallel clients test _users first
            self._users = users
        return list(self._users)

    def sentences(self, client: str, split: str, limit: int) -> list[str]:
        """The first ``limit`` sentences (``tokens``) of ``client`` in ``split``, in rowid order."""
        rows = self._query("SELECT serialized_example_proto FROM examples WHERE client_id = ? AND split_name = ? "
                           "ORDER BY rowid LIMIT ?", (client, split, limit))
        return [parse_tokens(blob, f"example {i} of client {client!r} ({split})") for i, (blob,) in enumerate(rows)]

    def _encode(self, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return to_xy([self.vocab.encode(s.split(" ")) for s in sentences])

    def user_data(self, user: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._users is None:
            self.users()
        if not isinstance(user, str) or user not in self._user_set:
            raise ConfigError(f"unknown stackoverflow user {user!r} (not a train client)")
        return self._cache.get(user, lambda: self._encode(
            self.sentences(user, "train", self.options["max_sentences"])))

    def heldout_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._heldout is None:
            split, want, cap = self.options["eval_split"], self.options["eval_sentences"], self.options["max_sentences"]
            sentences: list[str] = []
            for client in self.clients(split):
                if len(sentences) >= want:
                    break
                sentences += self.sentences(client, split, min(cap, want - len(sentences)))
            if not sentences:
                raise ConfigError(f"stackoverflow path {self.options['path']!r} has no {split} examples")
            self._heldout = self._encode(sentences)
        return self._heldout


# ---- so-synthetic ------------------------------------------------------------------------------

#: punctuation tokens of the generated language and their ids (ranks) in its vocabulary
PUNCTUATION = {".": 1, ",": 3, "?": 7}
_END = ((1, 0.75), (7, 0.25))  # a sentence ends with "." or "?"
_SUCCESSOR_WEIGHTS = np.array([0.5, 0.25, 0.15, 0.10])
_FOLLOW = 0.7  # P(next token from the previous token's topic successors) vs. from the topic unigram
_ZIPF = 1.07
_TOPIC_SPREAD = 1.5  # topic unigram = Zipf · exp(1.5·N(0,1)) per word
_ALPHA = 0.3  # Dirichlet concentration of a user's topic mix
_OOV_TAIL = 0.25  # the generator's word list is 25% longer than vocab_size: that tail is OOV

_SYN_DEFAULTS: dict[str, Any] = {
    "num_users": 1000, "seed": 0, "vocab_size": 10_000, "max_sentences": 256, "mean_sentences": 397.0,
    "min_sentences": 100, "sigma_sentences": 1.0, "mean_words": 12.0, "topics": 8, "eval_users": 40,
    "model_size": "small"}


def _lognormal_mu(mean: float, low: float, sigma: float) -> float:
    """mu of a lognormal(mu, sigma) conditioned on ≥ low whose mean is ``mean``."""
    phi, ln_low = statistics.NormalDist().cdf, math.log(low)

    def cond_mean(mu: float) -> float:
        tail = phi((mu - ln_low) / sigma)
        return math.exp(mu + sigma * sigma / 2) * phi((mu + sigma * sigma - ln_low) / sigma) / max(tail, 1e-300)

    lo, hi = ln_low - 30 * sigma, math.log(mean)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cond_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2


class SyntheticStackOverflowTask(TextTask):
    """StackOverflow-like generated users (``so-synthetic``), one user at a time from
    ``stable_seed(seed, kind, index)``.

    Assumptions (the real split's distributions beyond its mean are not published):

    * sentences per user: ⌊X⌋, X ~ lognormal(mu, ``sigma_sentences`` = 1) conditioned on X ≥
      ``min_sentences`` (100: TFF dropped users below 100), mu solved so that E[X] =
      ``mean_sentences`` (397, the train split's mean); then capped at ``max_sentences`` (256);
    * a language of U = ⌈1.25·vocab_size⌉ tokens, id = frequency rank of its Zipf(1.07) base;
      ranks above ``vocab_size`` map to OOV (the same id scheme as the real data); "." (id 1) and
      "?" (id 7) only end a sentence (3:1), "," (id 3) is an ordinary token;
    * ``topics`` (8) topics, each a unigram (the Zipf base times exp(1.5·N(0,1)) per token) and a
      bigram table: every token (and BOS) has 4 successors drawn from the topic's unigram, taken with
      probabilities .5/.25/.15/.10; the next token is a successor of the previous one with
      probability 0.7, else a draw from the topic's unigram;
    * a user's topic mix ~ Dirichlet(0.3, …) (non-IID); each sentence draws one topic from it;
    * sentence length (tokens, with the final punctuation): 1 + Geometric, mean ``mean_words``
      (12), so about 17% of sentences exceed 20 tokens and are truncated (no EOS).

    Users are "0" … "num_users-1"; ``evaluate`` uses ``eval_users`` further users drawn the same
    way (kind "heldout"), at most ``max_sentences`` sentences each.
    """

    name = "so-synthetic"

    @classmethod
    def _validate(cls, options: dict[str, Any]) -> dict[str, Any]:
        out = common_options("so-synthetic", check_options("so-synthetic", options, _SYN_DEFAULTS))
        out["vocab_size"] = checks.integer("so-synthetic vocab_size", out["vocab_size"], minimum=10)
        out["num_users"] = checks.integer("so-synthetic num_users", out["num_users"], minimum=1, maximum=100_000_000)
        out["min_sentences"] = checks.integer("so-synthetic min_sentences", out["min_sentences"],
                                              minimum=1, maximum=1_000_000)
        out["topics"] = checks.integer("so-synthetic topics", out["topics"], minimum=1, maximum=1000)
        out["eval_users"] = checks.integer("so-synthetic eval_users", out["eval_users"], minimum=1, maximum=1_000_000)
        out["mean_sentences"] = checks.interval("so-synthetic mean_sentences", out["mean_sentences"],
                                                out["min_sentences"], 1e7, low_open=True)
        out["sigma_sentences"] = checks.interval("so-synthetic sigma_sentences", out["sigma_sentences"],
                                                 0.05, 5.0)
        out["mean_words"] = checks.interval("so-synthetic mean_words", out["mean_words"], 1.0, 1000.0,
                                            low_open=True)
        return out

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self._mu = _lognormal_mu(o["mean_sentences"], o["min_sentences"], o["sigma_sentences"])
        self._tail = statistics.NormalDist().cdf((math.log(o["min_sentences"]) - self._mu) / o["sigma_sentences"])
        size = math.ceil((1 + _OOV_TAIL) * o["vocab_size"])  # tokens 1..size
        rng = np.random.Generator(np.random.PCG64(stable_seed(o["seed"], "so-synthetic", "language")))
        base = np.arange(1, size + 1, dtype=np.float64) ** -_ZIPF
        base[[r - 1 for r, _ in _END]] = 0.0
        weights = base[None, :] * np.exp(_TOPIC_SPREAD * rng.standard_normal((o["topics"], size)))
        self._cdf = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)
        self._cdf[:, -1] = 1.0
        # successors[k, r] for r = 0 (BOS) … size: 4 token ranks (1-based) drawn from topic k's unigram
        self._successors = np.stack([
            np.searchsorted(self._cdf[k], rng.random((size + 1, len(_SUCCESSOR_WEIGHTS))), side="right") + 1
            for k in range(o["topics"])]).astype(np.int64)
        self._size = size
        self._cache = LRU(_CACHE_USERS)
        self._heldout: tuple[torch.Tensor, torch.Tensor] | None = None

    def users(self) -> list[str]:
        return [str(i) for i in range(self.options["num_users"])]

    def _rng(self, kind: str, index: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(stable_seed(self.options["seed"], "so-synthetic", kind, index)))

    def _count(self, rng: np.random.Generator) -> int:
        """Sentences of one user before the cap (the first draw of the user's generator)."""
        o = self.options
        u = self._tail + float(rng.random()) * (1.0 - self._tail)
        z = statistics.NormalDist().inv_cdf(min(max(u, 1e-300), 1.0 - 1e-16))
        return max(o["min_sentences"], int(math.exp(self._mu + o["sigma_sentences"] * z)))

    def sentence_count(self, user: str, kind: str = "train") -> int:
        """A user's number of sentences before the ``max_sentences`` cap (cheap: no text drawn)."""
        return self._count(self._rng(kind, self._index(user) if kind == "train" else int(user)))

    def topic_mix(self, user: str) -> np.ndarray:
        """The user's topic mixture (the generator's second draw)."""
        rng = self._rng("train", self._index(user))
        self._count(rng)
        return rng.dirichlet(np.full(self.options["topics"], _ALPHA))

    def _draw(self, kind: str, index: int) -> list[list[int]]:
        """One user's sentences as token ranks (1..size), capped at max_sentences."""
        o = self.options
        rng = self._rng(kind, index)
        n = min(self._count(rng), o["max_sentences"])
        mix = rng.dirichlet(np.full(o["topics"], _ALPHA))
        topics = rng.choice(o["topics"], size=n, p=mix)
        lengths = rng.geometric(1.0 / o["mean_words"], size=n)  # >= 1, mean mean_words
        ends = np.where(rng.random(n) < _END[0][1], _END[0][0], _END[1][0])
        total = int(lengths.sum())
        follow = rng.random(total) < _FOLLOW
        pick = np.searchsorted(np.cumsum(_SUCCESSOR_WEIGHTS), rng.random(total), side="right")
        pick = np.minimum(pick, len(_SUCCESSOR_WEIGHTS) - 1)
        token_topic = np.repeat(topics, lengths)
        uniform = rng.random(total)
        unigram = np.empty(total, dtype=np.int64)
        for k in np.unique(token_topic):
            sel = token_topic == k
            unigram[sel] = np.searchsorted(self._cdf[k], uniform[sel], side="right") + 1
        unigram = np.minimum(unigram, self._size)
        successors = self._successors
        follow_l, pick_l, unigram_l = follow.tolist(), pick.tolist(), unigram.tolist()
        out: list[list[int]] = []
        t = 0
        for s in range(n):
            k, length = int(topics[s]), int(lengths[s])
            table = successors[k]
            prev, sentence = 0, []
            for _ in range(length - 1):  # the last token is the end punctuation
                prev = int(table[prev, pick_l[t]]) if follow_l[t] else unigram_l[t]
                sentence.append(prev)
                t += 1
            t += 1
            sentence.append(int(ends[s]))
            out.append(sentence)
        return out

    def _encode(self, sentences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.vocab_size
        oov = v + 1
        return to_xy([frame([r if r <= v else oov for r in s[:20]], v) for s in sentences])

    def _index(self, user: str) -> int:
        if not isinstance(user, str) or not user.isdigit() or str(int(user)) != user \
                or int(user) >= self.options["num_users"]:
            raise ConfigError(f"unknown so-synthetic user {user!r} (users are '0'..'{self.options['num_users'] - 1}')")
        return int(user)

    def user_sentences(self, user: str) -> list[list[int]]:
        """The user's generated sentences as token ids before truncation (OOV not yet mapped)."""
        return self._draw("train", self._index(user))

    def user_data(self, user: str) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._index(user)
        return self._cache.get(user, lambda: self._encode(self._draw("train", index)))

    def heldout_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._heldout is None:
            parts = [self._encode(self._draw("heldout", i)) for i in range(self.options["eval_users"])]
            self._heldout = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        return self._heldout
