"""Streaming correlated noise in torch: the noise of round t is std·(L z)_t, L = C^{-1}.

The fresh rows z come from keyed, counter-based draws (``fedmf.round.draws``); L comes from the
mechanism as one description (``Mechanism.streaming_inverse()``, see fedmf.mechanisms.streaming),
interpreted by ``fedmf.round.structures``.

Salts (``salted=True``; every private run uses them): each call of ``next()`` for round t
draws a fresh 16-byte salt from the OS's secure source before any of the round's fresh rows,
and those rows are keyed by it (``fedmf.round.draws``). The salts of the rounds done are part
of the state, so a generator restored from it regenerates past draws exactly, but a round drawn
again after a restore (or by a copy of the seed) gets new, independent fresh noise.

The state (format 4) is bound to its mechanism by ``Mechanism.fingerprint``. Its
``structure_rounds`` labels every kept tensor with the round whose ``next()`` produced it
(unchanged while it stays in the state, so a checkpoint writer can store it once), or None
for a tensor updated every round (BLT buffers).

The seed is a secret (anyone holding it can subtract the noise): it is never printed,
logged or put in error messages. ``state_dict()`` contains it (store it like a key) unless
``include_seed=False``, which puts a keyed check value in its place.
"""

from __future__ import annotations

import hmac
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import checks
from ..errors import CheckpointError, ConfigError, HorizonReached, PlanMismatch
from ..mechanisms.base import Mechanism
from .draws import CHUNK_SIZE, SALT_BYTES, Draws, is_int, new_key, seed_check
from .structures import structure

__all__ = ["NoiseGenerator", "Layout"]

Layout = int | Mapping[str, Sequence[int]]
#: 4: salts of the rounds done; 3: bound to the mechanism's fingerprint, seed or seed_check,
#: structure_rounds (read as 4 with every round unsalted); 2: std folded into the draws by
#: fedmf.round.normal; 1: another sampler, unscaled state
_STATE_FORMAT = 4
_UNSALTED_FORMAT = 3
_FLOATING = checks.floating_dtypes()


# ---- validation ------------------------------------------------------------------------
def _layout_size(layout: Layout) -> tuple[int, list[tuple[str, tuple[int, ...]]] | None]:
    if is_int(layout):
        if layout <= 0:
            raise ConfigError(f"layout size must be positive, got {layout}")
        return int(layout), None
    if isinstance(layout, Mapping) and layout:
        shapes = list(checks.layout(layout).items())
        return sum(math.prod(s) for _, s in shapes), shapes
    raise ConfigError("layout must be a positive int or a non-empty mapping name -> shape")


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from None
    if dev.type == "meta":
        raise ConfigError("device 'meta' holds no values: noise needs a real device")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but CUDA is not available")
        if dev.index is None:  # tensors report cuda:N, never bare cuda
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    elif dev.type != "cpu":
        try:
            torch.empty(1, device=dev)
        except (RuntimeError, AssertionError):
            raise ConfigError(f"device {device!r} is not available") from None
    return dev


def _shard(shard: Any) -> tuple[int, int]:
    if (isinstance(shard, (tuple, list)) and len(shard) == 2 and all(is_int(x) for x in shard)
            and shard[1] >= 1 and 0 <= shard[0] < shard[1]):
        return int(shard[0]), int(shard[1])
    raise ConfigError(f"shard must be (i, s) with ints 0 <= i < s, got {shard!r}")


def _snapshot(x: torch.Tensor, copy: bool) -> torch.Tensor:
    x = x.detach()
    if x.device.type != "cpu":
        return x.cpu()
    return x.clone() if copy else x


class NoiseGenerator:
    """Correlated noise for each round of ``mechanism``, in ``layout``, scaled by ``std``.

    ``next()`` returns round t's noise std·(C^{-1} z)_t (a dict of tensors for a dict
    layout, else a flat tensor) in ``dtype`` on ``device``. Same seed, mechanism, layout,
    device and dtype (and salts) ⇒ bit-identical noise. ``salted``: key each round's fresh
    rows with a new random salt (module docstring), so that a round drawn again after a restore
    never repeats the noise drawn before; past rounds are still regenerated exactly from the
    state's salts. ``shard=(i, s)`` produces only the i-th of s contiguous slices of the
    flattened parameters; the slices concatenate to the full noise (for a salted generator:
    when every shard gets the same ``salt`` in ``next``). Every argument is checked here
    (``fedmf.errors.ConfigError``).
    """

    def __reduce__(self):  # it holds a secret: never pickled (save state_dict() instead)
        checks.refuse_pickle(self)

    def __init__(
        self,
        mechanism: Mechanism,
        layout: Layout,
        std: float,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        seed: bytes | int | None = None,
        shard: tuple[int, int] = (0, 1),
        regenerate: bool = False,
        chunk_size: int = CHUNK_SIZE,
        salted: bool = False,
    ) -> None:
        if not isinstance(mechanism, Mechanism):
            raise ConfigError(f"mechanism must be a fedmf Mechanism, got {type(mechanism).__name__}")
        self.std = checks.non_negative("std", std)
        if dtype not in _FLOATING:
            raise ConfigError(f"dtype must be a floating torch dtype, got {dtype!r}")
        if not isinstance(regenerate, bool):
            raise ConfigError(f"regenerate must be True or False, got {regenerate!r}")
        if not isinstance(salted, bool):
            raise ConfigError(f"salted must be True or False, got {salted!r}")
        self.salted = salted
        if not is_int(chunk_size) or chunk_size <= 0:
            raise ConfigError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.mechanism = mechanism
        self.layout = layout
        self.total, self._shapes = _layout_size(layout)
        self.dtype = dtype
        self.device = _device(device)
        self.shard_index, self.shard_count = _shard(shard)
        self._key = new_key(seed)
        self.lo = self.total * self.shard_index // self.shard_count
        self.hi = self.total * (self.shard_index + 1) // self.shard_count
        self.regenerate = regenerate
        self.chunk_size = int(chunk_size)
        self._fingerprint = mechanism.fingerprint
        self._draws = Draws(self._key, self.total, self.lo, self.hi, dtype, self.device, self.chunk_size,
                             self.std)
        self._structure = structure(mechanism.streaming_inverse(), self._draws, regenerate)
        self.round = 0
        self._row = 0  # next fresh noise row
        self._salts: list[bytes] = []  # salt of each round done (b"": unsalted)
        self._draws.salts = []  # salt of each fresh row drawn

    def __repr__(self) -> str:  # never shows the seed
        return (f"NoiseGenerator(kind={self.mechanism.kind!r}, rounds={self.mechanism.rounds}, round={self.round}, "
                f"size={self.hi - self.lo}/{self.total}, dtype={self.dtype}, device={self.device})")

    @property
    def rounds(self) -> int:
        return self.mechanism.rounds

    def next(self, out: torch.Tensor | None = None, *,
             salt: bytes | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """The noise of the next round; raises ``HorizonReached`` once the mechanism's horizon
        is reached. A salted generator keys the round's fresh rows with ``salt`` (16 bytes;
        default: new ones from the OS's secure source — give one only to make shards agree).

        ``out``: an optional flat, contiguous tensor of this shard's size, dtype and device to
        write into (reusing one buffer saves a fresh allocation, and its page faults, per round);
        the result is then a view of ``out``, overwritten by the next call that gets the same
        ``out``: copy it (or add it to the model) before asking for the next round."""
        t = self.round
        if t >= self.mechanism.rounds:
            raise HorizonReached(
                f"noise for round {t} requested, but the mechanism covers rounds 0..{self.mechanism.rounds - 1}; "
                "noise is never repeated or reused"
            )
        size = self.hi - self.lo
        if out is None:
            out = torch.empty(size, dtype=self.dtype, device=self.device)
        elif not (isinstance(out, torch.Tensor) and out.shape == (size,) and out.dtype == self.dtype
                  and out.device == self.device and out.is_contiguous()):
            raise ConfigError(f"out must be a contiguous flat tensor of {size} elements, dtype {self.dtype}, "
                              f"device {self.device}")
        if salt is None:
            salt = secrets.token_bytes(SALT_BYTES) if self.salted else b""
        elif not (self.salted and isinstance(salt, bytes) and len(salt) == SALT_BYTES):
            raise ConfigError(f"salt must be {SALT_BYTES} bytes, given to a salted generator")
        rows = self.mechanism.fresh_rows(t)
        self._draws.salts[self._row:] = [salt] * rows  # before any of the round's fresh rows is drawn
        try:
            flat = self._structure.step(t, self._row, out)
        except BaseException:
            del self._draws.salts[self._row:]
            raise
        self._row += rows
        self._salts.append(salt)
        self.round += 1
        return self._unflatten(flat)

    def _unflatten(self, flat: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        if self._shapes is None or self.shard_count > 1:
            return flat
        out, offset = {}, 0
        for name, shape in self._shapes:
            size = math.prod(shape)
            out[name] = flat[offset : offset + size].view(shape)
            offset += size
        return out

    # ---- checkpointing ---------------------------------------------------------------
    def state_dict(self, include_seed: bool = True, copy: bool = True) -> dict[str, Any]:
        """Everything needed to continue exactly. With ``include_seed`` (the default) it
        contains the secret seed; without, a ``seed_check`` in its place, and it loads only
        into a generator constructed with the same seed. ``copy=False`` returns the live CPU
        tensors (no copy of up to p − 1 noise vectors): serialize it before the next round."""
        if not isinstance(include_seed, bool):
            raise ConfigError(f"include_seed must be True or False, got {include_seed!r}")
        secret = {"seed": self._key} if include_seed else {"seed_check": seed_check(self._key)}
        return {
            "format": _STATE_FORMAT,
            "fingerprint": self._fingerprint,
            "kind": self.mechanism.kind,
            "rounds": self.mechanism.rounds,
            "round": self.round,
            "row": self._row,
            "total": self.total,
            "shard": (self.shard_index, self.shard_count),
            "dtype": str(self.dtype),
            "std": self.std,
            "regenerate": self.regenerate,
            "chunk_size": self.chunk_size,
            "salts": [salt.hex() for salt in self._salts],  # hex: torch.load(weights_only) refuses b""
            **secret,
            "structure": {k: [_snapshot(x, copy) for x in v] for k, v in self._structure.state().items()},
            "structure_rounds": self._structure.rounds(self.round),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint written by ``state_dict`` for the same mechanism
        (fingerprint), layout, shard, std, dtype and chunking; all is checked before anything
        changes (``CheckpointError`` for an unreadable state, ``PlanMismatch`` for another one)."""
        # formats before 3 are not bound to their mechanism: never read
        fmt = checks.state_format(state, "noise state", (_UNSALTED_FORMAT, _STATE_FORMAT))
        if state.get("fingerprint") != self._fingerprint:
            raise PlanMismatch(f"noise state was written for another mechanism (fingerprint "
                               f"{str(state.get('fingerprint'))[:80]}, expected {self._fingerprint})")
        expected = {"kind": self.mechanism.kind, "rounds": self.mechanism.rounds, "total": self.total,
                    "shard": (self.shard_index, self.shard_count), "dtype": str(self.dtype), "std": self.std,
                    "regenerate": self.regenerate, "chunk_size": self.chunk_size}
        for name, value in expected.items():
            got = state.get(name)
            if name == "shard" and isinstance(got, (tuple, list)):
                got = tuple(got)
            if got != value:
                raise PlanMismatch(f"noise state does not match this generator: {name} is {str(got)[:80]}, "
                                   f"expected {value!r}")
        key = self._state_key(state)
        t, row = self._state_position(state)
        salts = self._state_salts(state, t) if fmt == _STATE_FORMAT else [b""] * t
        self._check_structure(state, t)
        self._key = key
        self._draws.key = key
        self.round, self._row = t, row
        self._salts = salts
        self._draws.salts = [salt for s in range(t) for salt in [salts[s]] * self.mechanism.fresh_rows(s)]
        self._structure.load(state["structure"], t, row)

    @staticmethod
    def _state_salts(state: Mapping[str, Any], t: int) -> list[bytes]:
        salts = state.get("salts")
        if not (isinstance(salts, (list, tuple)) and len(salts) == t
                and all(isinstance(x, str) and len(x) in (0, 2 * SALT_BYTES) for x in salts)):
            raise CheckpointError(f"noise state must hold one salt (empty or {SALT_BYTES} bytes in hex) for each of "
                                  f"its {t} rounds")
        try:
            return [bytes.fromhex(x) for x in salts]
        except ValueError:
            raise CheckpointError("noise state holds a salt that is not hex") from None

    def _state_key(self, state: Mapping[str, Any]) -> bytes:
        if "seed" in state:
            seed = state["seed"]
            if not (isinstance(seed, (bytes, bytearray)) and 1 <= len(seed) <= 64):
                raise CheckpointError("noise state holds an invalid seed (expected 1 to 64 bytes)")
            return bytes(seed)
        if "seed_check" in state:
            if not (isinstance(state["seed_check"], str)
                    and hmac.compare_digest(state["seed_check"], seed_check(self._key))):
                raise PlanMismatch("noise state was written with another seed (its seed_check differs from "
                                   "this generator's)")
            return self._key
        raise CheckpointError("noise state holds neither a seed nor a seed_check")

    def _state_position(self, state: Mapping[str, Any]) -> tuple[int, int]:
        t, row = state.get("round"), state.get("row")
        if not (is_int(t) and 0 <= t <= self.mechanism.rounds):
            raise CheckpointError(f"noise state has round {str(t)[:40]}, outside 0..{self.mechanism.rounds}")
        if row != sum(self.mechanism.fresh_rows(s) for s in range(t)):
            raise CheckpointError(f"noise state has row {str(row)[:40]}, inconsistent with round {t}")
        return int(t), int(row)

    def _check_structure(self, state: Mapping[str, Any], t: int) -> None:
        structure = state.get("structure")
        labels = self._structure.rounds(t)
        if not isinstance(structure, Mapping) or set(structure) != set(labels):
            raise CheckpointError(f"noise state structure must hold {sorted(labels)} for this mechanism")
        size = self.hi - self.lo
        for name, expected in labels.items():
            tensors = structure[name]
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(expected):
                raise CheckpointError(f"noise state structure {name!r} must hold {len(expected)} tensors at round {t}")
            if not all(isinstance(x, torch.Tensor) and x.shape == (size,) for x in tensors):
                raise CheckpointError(f"noise state structure {name!r} must hold flat tensors of {size} elements")

    def shard(self, index: int, count: int) -> NoiseGenerator:
        """A generator for the i-th of ``count`` slices, at this generator's current round."""
        if self.shard_count != 1:
            raise ConfigError("shard() splits an unsharded generator")
        child = NoiseGenerator(self.mechanism, self.layout, self.std, dtype=self.dtype, device=self.device,
                               seed=self._key, shard=(index, count), regenerate=self.regenerate,
                               chunk_size=self.chunk_size, salted=self.salted)
        child.round, child._row = self.round, self._row
        child._salts, child._draws.salts = list(self._salts), list(self._draws.salts)
        child._structure.load(self._structure.slice(child.lo, child.hi), self.round, self._row)
        return child
