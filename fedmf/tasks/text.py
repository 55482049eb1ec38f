"""The text pipeline shared by the next-word tasks (stackoverflow, so-synthetic, shakespeare).

Ids exactly as TFF's StackOverflow word prediction (``word_prediction_preprocessing`` /
``stackoverflow_word_prediction.build_to_ids_fn``) with ``V = vocab_size`` and one OOV bucket:

* pad 0; the V words 1..V (most frequent first); OOV V+1; BOS V+2; EOS V+3 (V+4 ids);
* a sentence's words are cut to ``SEQ_LEN`` = 20; EOS is appended only if fewer than 20 remain;
  BOS is prepended; the sequence is padded with 0 to 21; x = seq[:-1], y = seq[1:].

So BOS is never a target, a sentence of 20 or more words has no EOS, and every row has at least
one non-pad target (y[0]). :class:`TextTask` adds the model, the pad-masked loss and TFF's metrics
to :class:`~fedmf.tasks.supervised.SupervisedTask`'s local SGD.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .. import checks
from ..errors import ConfigError
from ..threads import one_thread
from .base import ClientHyper, LocalResult, stable_seed
from .batched_lstm import batched_local_updates, supports_batched
from .losses import softmax_cross_entropy
from .models import MODEL_SIZES, WordLSTM, empty_word_model, make_word_model
from .supervised import SupervisedTask

__all__ = ["SEQ_LEN", "PAD", "Vocab", "special_ids", "frame", "to_xy", "read_word_counts", "top_words",
           "TextTask", "LRU"]

SEQ_LEN = 20
PAD = 0
_EVAL_CHUNK = 32  # sentences per forward pass in evaluation (small chunks stay in cache: faster, less memory)
_EVAL_CHUNK_ACCELERATOR = 1024  # on a GPU larger chunks keep it busy


def special_ids(vocab_size: int) -> tuple[int, int, int, int]:
    """(pad, oov, bos, eos) for ``vocab_size`` words."""
    return PAD, vocab_size + 1, vocab_size + 2, vocab_size + 3


class Vocab:
    """The ``vocab_size`` words → ids 1..len(words) (most frequent first), everything else OOV."""

    def __init__(self, words: Sequence[str], vocab_size: int) -> None:
        if len(words) > vocab_size:
            raise ConfigError(f"{len(words)} words do not fit a vocabulary of {vocab_size}")
        self.words = tuple(words)
        self.vocab_size = vocab_size
        self.index = {w: i + 1 for i, w in enumerate(self.words)}
        if len(self.index) != len(self.words):
            raise ConfigError("the vocabulary has a repeated word")
        self.pad, self.oov, self.bos, self.eos = special_ids(vocab_size)

    def lookup(self, words: Iterable[str]) -> list[int]:
        oov, index = self.oov, self.index
        return [index.get(w, oov) for w in words]

    def encode(self, words: Sequence[str]) -> list[int]:
        """TFF's to_ids + padding: the 21 ids of one sentence given as its words."""
        return frame(self.lookup(words[:SEQ_LEN]), self.vocab_size)


def frame(ids: Sequence[int], vocab_size: int, seq_len: int = SEQ_LEN) -> list[int]:
    """Word ids (already looked up) → [BOS] + ids[:seq_len] + ([EOS] if fewer than seq_len) + pad
    to seq_len + 1."""
    _, _, bos, eos = special_ids(vocab_size)
    ids = list(ids[:seq_len])
    if len(ids) < seq_len:
        ids.append(eos)
    seq = [bos, *ids]
    return seq + [PAD] * (seq_len + 1 - len(seq))


def to_xy(seqs: Sequence[Sequence[int]], seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Framed sequences → (x, y) int64 tensors of shape (n, seq_len)."""
    t = torch.tensor(seqs, dtype=torch.int64).reshape(len(seqs), seq_len + 1)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def read_word_counts(path: str, vocab_size: int) -> list[str]:
    """The first ``vocab_size`` words of a ``word count`` per line file (TFF's
    ``stackoverflow.word_count``: most frequent first). ConfigError if it has fewer."""
    words: list[str] = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if len(words) >= vocab_size:
                    break
                parts = line.split()
                if len(parts) != 2 or not parts[1].isdigit():
                    raise ConfigError(f"vocab file {path}: line {number} is not 'word count': {line.strip()[:60]!r}")
                words.append(parts[0])
    except OSError as e:
        raise ConfigError(f"cannot read vocab file {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"vocab file {path!r} is not UTF-8 text") from None
    if len(words) < vocab_size:
        raise ConfigError(f"vocab file {path} has {len(words)} words, fewer than vocab_size {vocab_size}")
    if len(set(words)) != len(words):
        raise ConfigError(f"vocab file {path} repeats a word among its first {vocab_size}")
    return words


def top_words(counts: Mapping[str, int], k: int) -> list[str]:
    """The ``k`` most frequent words, ties by the word (deterministic)."""
    return [w for w, _ in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))[:k]]


class LRU:
    """A small least-recently-used cache of users' tensors (data are built lazily, never all)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._data: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # parallel clients (``local_updates(workers=...)``) share it

    def get(self, key: str, build: Any) -> Any:
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        value = build()  # outside the lock: two threads may build one key; both values are equal
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self.size:
                self._data.popitem(last=False)
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["size"])


class TextTask(SupervisedTask):
    """Next-word prediction over (x, y) int64 (n, 20) tensors. Subclasses set ``name`` and
    provide ``users``, ``user_data``, ``heldout_data`` and ``vocab_size``; options include ``seed``
    and ``model_size``."""

    @property
    def vocab_size(self) -> int:
        return self.options["vocab_size"]

    def model(self) -> torch.nn.Module:
        """A fresh model holding the task's initial state (drawn once per task object, then copied:
        ``load`` builds a model for every local update)."""
        if getattr(self, "_initial", None) is None:
            init = make_word_model(self.options["model_size"], self.vocab_size,
                                   stable_seed(self.options["seed"], self.name, "model"))
            self._initial = {k: v.detach().clone() for k, v in init.state_dict().items()}
        model = empty_word_model(self.options["model_size"], self.vocab_size)
        model.load_state_dict(self._initial)
        return model

    def criterion(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the non-pad targets of the batch."""
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 ignore_index=PAD)

    def vectorized_pad_label(self) -> int | None:
        """``PAD`` for this class's pad-masked criterion (the vectorized path pads batches with it)."""
        if type(self).criterion is TextTask.criterion and type(self).local_update is SupervisedTask.local_update:
            return PAD
        return super().vectorized_pad_label()

    def vectorized_updates(self, params: Mapping[str, torch.Tensor], users: Sequence[str], round: int,
                           hyper: ClientHyper, *, device: str | torch.device | None = None,
                           chunk_users: int | None = None) -> dict[str, LocalResult] | None:
        """The batched LSTM path (:mod:`fedmf.tasks.batched_lstm`) for this class's loss, local SGD
        and a :class:`WordLSTM`; otherwise :class:`SupervisedTask`'s (``torch.func.vmap``)."""
        if self.vectorized_pad_label() == PAD and type(self).train_loss is TextTask.train_loss \
                and supports_batched(self):
            return batched_local_updates(self, params, users, round, hyper, device=device, chunk_users=chunk_users)
        return super().vectorized_updates(params, users, round, hyper, device=device, chunk_users=chunk_users)

    def train_loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``criterion(model(x), y)``'s value and gradient, computed on the non-pad targets only:
        the LSTM runs up to the batch's last non-pad target (it is causal), the head and the
        softmax on the non-pad positions (pad targets add nothing to the masked mean or its
        gradient). About half of a text batch is padding: 1.6x faster per update (BENCHMARKS.md)."""
        targeted = _target_logits(model, x, y) if type(self).criterion is TextTask.criterion else None
        if targeted is None:  # another loss or model, or no target: the whole model, the criterion
            return super().train_loss(model, x, y)
        return softmax_cross_entropy(*targeted)

    def _score(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Token-weighted over all rows: loss and accuracy without pad; accuracy without pad, OOV
        and EOS (TFF's masked accuracies; BOS is never a target; argmax over all ids)."""
        _, oov, _, eos = special_ids(self.vocab_size)
        training = model.training
        model.eval()
        loss_sum, tokens, correct, tokens2, correct2 = 0.0, 0, 0, 0, 0
        try:
            with torch.no_grad(), one_thread():
                chunk = _EVAL_CHUNK if x.device.type == "cpu" else _EVAL_CHUNK_ACCELERATOR
                for start in range(0, len(y), chunk):
                    xb, yb = x[start:start + chunk], y[start:start + chunk]
                    targeted = _target_logits(model, xb, yb)  # the non-pad targets alone are scored
                    logits, yb = (model(xb), yb) if targeted is None else targeted
                    loss_sum += float(torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), yb.reshape(-1), ignore_index=PAD, reduction="sum"))
                    hit = logits.argmax(dim=-1) == yb
                    mask = yb != PAD
                    mask2 = mask & (yb != oov) & (yb != eos)
                    tokens += int(mask.sum())
                    correct += int((hit & mask).sum())
                    tokens2 += int(mask2.sum())
                    correct2 += int((hit & mask2).sum())
        finally:
            model.train(training)
        if tokens == 0:
            raise ConfigError(f"{self.name}: nothing to evaluate (no non-pad targets)")
        return {"loss": loss_sum / tokens, "accuracy": correct / tokens,
                "accuracy_no_oov_eos": correct2 / tokens2 if tokens2 else 0.0}


def _target_logits(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits, targets) of the batch's non-pad targets only, for a :class:`WordLSTM` (causal:
    ``features`` runs up to the last non-pad target; ``head`` is per position); None to run the
    whole model (another model, or a batch without targets)."""
    if not isinstance(model, WordLSTM):
        return None
    columns = (y != PAD).any(dim=0).nonzero()
    if len(columns) == 0:
        return None
    steps = int(columns[-1]) + 1
    keep = y[:, :steps] != PAD
    return model.head(model.features(x[:, :steps])[keep]), y[:, :steps][keep]


def common_options(task: str, out: dict[str, Any]) -> dict[str, Any]:
    """Validate the options every text task has (seed, model_size, vocab_size, max_sentences)."""
    out["seed"] = checks.integer(f"{task} seed", out["seed"], minimum=0, maximum=2**63 - 1)
    checks.one_of("model_size", out["model_size"], sorted(MODEL_SIZES))
    out["vocab_size"] = checks.integer(f"{task} vocab_size", out["vocab_size"], minimum=1, maximum=1_000_000)
    if "max_sentences" in out:
        out["max_sentences"] = checks.integer(f"{task} max_sentences", out["max_sentences"],
                                              minimum=1, maximum=10_000_000)
    return out
