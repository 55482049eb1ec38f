"""Issue-35 review of the noise split (commit e327c4a) and the mechanism registry: the released noise
pinned to what fedmf/noise.py drew at 4c6cbb1 (hashes computed in that tree, PYTHONPATH-selected),
with a checkpoint round trip mid-run, and the registry's refusal of a file-only kind
(docs/reviews/REVIEW-i35-sampling-noise.md)."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

from fedmf import mechanisms
from fedmf.errors import ConfigError, HorizonReached
from fedmf.participation import MinSep
from fedmf.round.noise import NoiseGenerator
from fedmf.workloads import Workload

ROUNDS = 8
SEED = 1234
LAYOUT = {"w": (3, 5), "b": (7,)}
SALTS = [bytes([t]) * 16 for t in range(ROUNDS)]
MECHANISMS = {"bsr": (MinSep(2, 4), Workload()), "tree": (MinSep(4, 2), Workload(momentum=0.9))}
#: sha256[:16] of each round's noise at 4c6cbb1 (fedmf/noise.py), std 0.7
GOLDEN = {
    ('bsr', 'float32', 'plain'): '1b2f5c86ba7d25ed d78587b9b6b84892 fc11949c4bb68bfe a820154fbbf5f824 855dae500ea2a204 b7cb97ad537057a4 436a05cc316fad52 a19a718089505f9d',
    ('bsr', 'float32', 'salted'): '0edb73f8e81dfe90 86d3341090ba4016 3e2c4a33367749e4 515645559e1b53ba 91ce9839b2d1522c 5a19de0f1fe11ada 9be70b943490cf07 07ded1e48ad17180',
    ('bsr', 'float32', 'regen'): '1b2f5c86ba7d25ed d78587b9b6b84892 fc11949c4bb68bfe a820154fbbf5f824 855dae500ea2a204 b7cb97ad537057a4 436a05cc316fad52 a19a718089505f9d',
    ('bsr', 'float32', 'shard'): '2ac1cb6aa84c465e 49d061f0eb99da7e 2ea75e7a9fbbef15 a5affd24981b78ce 5bccb5a7bb5ac52e 77eb8be6186e946a f736a87b0dbce045 d146be19cbca3c13',
    ('bsr', 'float64', 'plain'): '24c028284f3b596b 8bade62465d457a5 b261959991a7c96f b3b4934d49bdc585 85a434151784b06b 796df0f108b98b4e 1963417a91b8b012 6cea9b8e4b2aeaa5',
    ('bsr', 'float64', 'salted'): 'd18033da5e2046e6 1db15c416cc38ea8 8bd2cc5410f19714 564081d45cbe4fde 60116b530b64d6be f7a73fe162df2c76 f38fd9a366ffd113 fb56cb58317a0432',
    ('bsr', 'float64', 'regen'): '24c028284f3b596b 8bade62465d457a5 b261959991a7c96f b3b4934d49bdc585 85a434151784b06b 796df0f108b98b4e 1963417a91b8b012 6cea9b8e4b2aeaa5',
    ('bsr', 'float64', 'shard'): '9f4b9a81e26a7812 4163dbc62052806d 404e7c6c59116baf bf82952ffcaf0654 bb326c8d3181d9f7 6ad26ee66587c356 110876c438ed94a9 9a67e8b773b699d9',
    ('tree', 'float32', 'plain'): '1b2f5c86ba7d25ed 78ac6b541ff5437b f5b9d8ab04cff0e2 b74b1662c089895c aa3a865c0ae76816 67724f106e7b04ea 8643a99c47e91a92 9a2293fbf9bb540f',
    ('tree', 'float32', 'salted'): '0edb73f8e81dfe90 dfda3f0000347e92 ed4145c6b446d2d9 5be48f0f9bcef3ef e576b199fcfa6938 71468cd1e5664f37 b59c6b4c9cd67919 4c184a3d3a65d25d',
    ('tree', 'float32', 'regen'): '1b2f5c86ba7d25ed 78ac6b541ff5437b f5b9d8ab04cff0e2 b74b1662c089895c aa3a865c0ae76816 67724f106e7b04ea 8643a99c47e91a92 9a2293fbf9bb540f',
    ('tree', 'float32', 'shard'): '2ac1cb6aa84c465e b5c1e4670646bb0b 6a120fd1ee71ae74 b2c7924d0ec9e00e 73986757195fb70f 26809991eb6d83cf d87ef93d9b3c0575 80428dd27314412f',
    ('tree', 'float64', 'plain'): '24c028284f3b596b 33864dc4ebe38c2b 37216b42daf3a033 c5cb36a72ee4a73c b7aa5af1e78f77ce 24ef030863e9cd2b 067c3e88b78b7fd1 23b01909a6ee9f51',
    ('tree', 'float64', 'salted'): 'd18033da5e2046e6 afa17bcb7686f2f4 3dd2e2199d537d7b 8a4ee1f90bc5af84 5aaf28724ff164c6 912ed6fe1158ffb4 f7796c721fe0e052 de2d6675131a8b7e',
    ('tree', 'float64', 'regen'): '24c028284f3b596b 33864dc4ebe38c2b 37216b42daf3a033 c5cb36a72ee4a73c b7aa5af1e78f77ce 24ef030863e9cd2b 067c3e88b78b7fd1 23b01909a6ee9f51',
    ('tree', 'float64', 'shard'): '9f4b9a81e26a7812 59971e7fd9b0ff37 9b2d8e5539715e55 b325cfa4d8f99d04 38265be8dbfb9e01 9b6dadc475b071dd 0d39f8f3194094e9 a888cb0bbb46c096',
}


def _hash(x) -> str:
    if isinstance(x, dict):
        x = torch.cat([v.reshape(-1) for v in x.values()])
    return hashlib.sha256(x.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("kind, dtype, mode", sorted(GOLDEN))
def test_noise_is_bit_identical_to_the_tree_before_the_split(kind, dtype, mode):
    schema, workload = MECHANISMS[kind]
    mechanism, _ = mechanisms.plan(kind, ROUNDS, schema, workload)
    options = {"dtype": getattr(torch, dtype), "seed": SEED, "salted": mode == "salted",
               "regenerate": mode == "regen", "shard": (1, 3) if mode == "shard" else (0, 1)}
    layout = 22 if mode == "shard" else LAYOUT
    generator = NoiseGenerator(mechanism, layout, 0.7, **options)
    hashes = []
    for t in range(ROUNDS):
        if t == 3:  # a resume mid-run: the state through torch.save / torch.load(weights_only)
            buffer = io.BytesIO()
            torch.save(generator.state_dict(), buffer)
            buffer.seek(0)
            generator = NoiseGenerator(mechanism, layout, 0.7, **options)
            generator.load_state_dict(torch.load(buffer, weights_only=True))
            assert "seed" not in generator.state_dict(include_seed=False)
        hashes.append(_hash(generator.next(salt=SALTS[t]) if mode == "salted" else generator.next()))
    assert " ".join(hashes) == GOLDEN[(kind, dtype, mode)]
    with pytest.raises(HorizonReached):
        generator.next()


@pytest.mark.parametrize("options", [{}, {"min_sep_range": (2, 4)}, {"min_sep_range": (2, 4), "taper": True}])
def test_a_file_only_kind_is_never_planned(options):
    """4c6cbb1's plan fell through its if-chain to the robust optimizer for 'banded-inverse-toeplitz' given a
    min_sep_range (and returned a RobustToeplitz under the other kind's name); the registry refuses it."""
    with pytest.raises(ConfigError, match="read from a mechanism file"):
        mechanisms.plan("banded-inverse-toeplitz", ROUNDS, MinSep(2, 4), max_steps=3, **options)
