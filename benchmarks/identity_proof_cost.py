"""What one bogus identity proof costs the ServerApp (issue 34, item 4), side by side with one
Ed25519 signature verification.

    PYTHONPATH=$PWD python benchmarks/identity_proof_cost.py             # 2000 proofs per path
    PYTHONPATH=$PWD python benchmarks/identity_proof_cost.py --proofs 500 --json

Each path is timed on the same proofs, interleaved (one proof of each path in turn, so a load
change on the machine hits all paths alike), and the median per proof is reported:

* ``signature``: one OpenSSL Ed25519 verification of a valid signature under a loaded key
  (``Ed25519PublicKey.verify``) — the unit the target is stated in;
* ``before``: ``verify_proof`` with the enrolled key as raw bytes, which validates the key on every
  call (``check_public_key``: decoding, canonical encoding, small order — about 9 modular
  exponentiations in Python) and then verifies: what every proof cost before issue 34;
* ``after``: ``verify_proof`` with the key the enrollment validated and loaded once
  (``EnrolledKey``);
* ``directory``: the whole server-side check of one identity reply carrying a bogus signature
  (``NodeDirectory._check``: the reply's record, the user id, the population, the enrolled key, the
  signature), what a node sending a bogus proof costs the round loop.

Every signature in ``before``, ``after`` and ``directory`` is bogus (random 64 bytes, or a valid
signature over other fields): the server pays the full check and refuses it. The per-round worst
case for N nodes is N × ``directory`` (all N replies of one identity exchange are checked in turn,
in one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmf.enrollment import Enrollment, EnrollmentFile, new_challenge, proof_message, sign_proof, verify_proof  # noqa: E402
from server.identity import IDENTITY_RECORD, IdentityPolicy, NodeDirectory  # noqa: E402
from server.local_grid import LocalGrid  # noqa: E402

RUN = "1:" + "ab" * 16


def _raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def measure(proofs: int, users: int = 100) -> dict:
    keys = [Ed25519PrivateKey.generate() for _ in range(users)]
    ids = [f"user-{i}" for i in range(users)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "enrollment.json"
        Enrollment({u: _raw(k) for u, k in zip(ids, keys)}).save(path)
        source = EnrollmentFile(path)
    enrollment = source.enrollment
    LocalGrid({})  # sets the task identity a Message needs outside a Flower runtime
    directory = NodeDirectory(IdentityPolicy("enrolled", source, frozenset(ids)), run=RUN)
    cases = []
    for i in range(proofs):
        user = ids[i % users]
        challenge, node = new_challenge(), 1000 + i
        valid_message = proof_message(RUN, 3, node, challenge, user)
        valid = keys[i % users].sign(valid_message)
        # bogus: random bytes, or the user's valid signature over another node's fields (a relay)
        bogus = secrets.token_bytes(64) if i % 2 else sign_proof(keys[i % users], RUN, 3, node + 1, challenge, user)
        query = Message(RecordDict({"config": ConfigRecord({"request": "identity"})}), dst_node_id=node,
                        message_type=MessageType.QUERY)
        reply = Message(RecordDict({IDENTITY_RECORD: ConfigRecord({"user-id": user, "signature": bogus})}),
                        reply_to=query)
        cases.append((user, node, challenge, valid_message, valid, bogus, reply))
    loaded = {u: k.public_key() for u, k in zip(ids, keys)}
    times: dict[str, list[float]] = {"signature": [], "before": [], "after": [], "directory": []}
    clock = time.perf_counter
    for user, node, challenge, valid_message, valid, bogus, reply in cases:
        raw, enrolled, public = enrollment.key(user), enrollment.verifier(user), loaded[user]
        start = clock()
        public.verify(valid, valid_message)
        times["signature"].append(clock() - start)
        start = clock()
        ok_before = verify_proof(raw, bogus, RUN, 3, node, challenge, user)
        times["before"].append(clock() - start)
        start = clock()
        ok_after = verify_proof(enrolled, bogus, RUN, 3, node, challenge, user)
        times["after"].append(clock() - start)
        start = clock()
        proven, _ = directory._check(reply, node, 3, challenge)
        times["directory"].append(clock() - start)
        assert not ok_before and not ok_after and proven is None  # every bogus proof refused
    medians = {k: statistics.median(v) for k, v in times.items()}
    unit = medians["signature"]
    return {"proofs": proofs, "median_us": {k: v * 1e6 for k, v in medians.items()},
            "ratio_to_signature": {k: v / unit for k, v in medians.items()},
            "nodes_1000_per_exchange_s": {k: 1000 * v for k, v in medians.items() if k != "signature"},
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proofs", type=int, default=2000, help="proofs per path (default 2000)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = measure(args.proofs)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.proofs} proofs per path, median per proof ({result['machine']}, Python {result['python']})")
    print(f"{'path':<11} {'median µs':>10} {'× signature':>12} {'1000 nodes, s':>14}")
    for name, us in result["median_us"].items():
        per_1000 = result["nodes_1000_per_exchange_s"].get(name)
        shown = "" if per_1000 is None else f"{per_1000:.3f}"
        print(f"{name:<11} {us:>10.1f} {result['ratio_to_signature'][name]:>12.2f} {shown:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
