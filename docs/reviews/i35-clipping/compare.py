"""Compare two dumps of releases.py (old tree, new tree) with torch.equal and exact float equality;
also check, in the new dump, that the resumed run equals the uninterrupted one and that each round
uses one salt, never reused across rounds.   python compare.py OLD.pt NEW.pt"""
import math
import sys

import torch


def same(x, y):
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


old, new = torch.load(sys.argv[1], weights_only=False), torch.load(sys.argv[2], weights_only=False)
assert old.keys() == new.keys()
bad = 0
for key in old:
    o, n = old[key], new[key]
    for part in ("full", "resumed", "calls", "calls_resumed", "state_keys"):
        if not same(o[part], n[part]):
            bad += 1
            print("DIFFER old/new", key, part)
    tail = n["full"][4:]
    if not same(tail, n["resumed"]):
        bad += 1
        print("RESUME differs from uninterrupted", key)
    salted = key[3]
    per_round = {}
    for stream, t, salt in n["calls"]:
        per_round.setdefault(t, set()).add(salt)
    salts = [s for t in sorted(per_round) for s in per_round[t]]
    if any(len(v) != 1 for v in per_round.values()) or (salted and len(set(salts)) != len(salts)):
        bad += 1
        print("SALT use", key, {t: len(v) for t, v in per_round.items()})
    zeros = [r["zeta_before"] for r in n["full"]]
    if key[1] and len(set(zeros)) == 1:
        print("note: zeta never moved", key)
    tensors = sum(len(r["mean"]) for r in n["full"] + n["resumed"])
    print("ok" if not bad else "..", key, f"{tensors} tensors", f"{len(n['calls'])} keyed draws")
print("MISMATCHES", bad)
