"""Can a lying server unmask one client past the consistency check? An exhaustive MILP search
(scipy's HiGHS) over the server's choices on a Harary ring (docs/secagg-consistency.md).

Target v = node 0 of a ring of n nodes, each linked to k/2 on each side. The server chooses, for
every node w: the sources it forwards at collect (srcs(w) ⊆ N(w), at least t − 1: the client's
check), at most one survivor story each node signs (an honest client signs once, only a story that
contains it, names alive only neighbours in srcs(w), and leaves it ≥ t survivors), and which
signers reveal (a revealer needs t signers of its own story in its closed neighbourhood, itself
included). The server needs v's seed (t shares) and, for every source of v, that source's mask
key (t shares) — or v's own key, which with v's seed the 2t > k + 1 rule already forbids.
Rules compared for when a revealer w gives the seed share of an owner x ∈ srcs(w) ∪ {w}:
  "in U3"     x is in w's story (a global U3, t neighbourhood signatures);
  "signed U3" x signed w's story (what client/secagg.py does).
A key share is given for x ∈ srcs(w) outside the story. Infeasible = no lie recovers v's update.
Run: python docs/secagg-consistency/lie_search.py
"""

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp


def attack_exists(n: int, k: int, t: int, rule: str) -> bool:
    half, stories = k // 2, n // t  # each story with a revealer has ≥ t signers
    nbrs = {w: {(w + o) % n for o in range(-half, half + 1) if o} for w in range(n)}
    index: dict[tuple, int] = {}
    rows: list[tuple[dict[int, float], float, float]] = []

    def x(*name) -> int:
        return index.setdefault(name, len(index))

    def at_most(coeffs: dict[int, float], hi: float) -> None:
        rows.append((coeffs, -np.inf, hi))

    def at_least(coeffs: dict[int, float], lo: float) -> None:
        rows.append((coeffs, lo, np.inf))

    for w in range(n):
        at_least({x("src", w, u): 1 for u in nbrs[w]}, t - 1)
        at_most({x("sign", w, s): 1 for s in range(stories)}, 1)
        for s in range(stories):
            sign, reveal = x("sign", w, s), x("reveal", w, s)
            at_most({sign: 1, x("in", s, w): -1}, 0)  # signs only a story that contains it
            for u in nbrs[w]:  # alive neighbours must be sources
                at_most({x("in", s, u): 1, sign: 1, x("src", w, u): -1}, 1)
            at_least({**{x("in", s, u): 1 for u in nbrs[w]}, sign: -(t - 1)}, 0)
            at_most({reveal: 1, sign: -1}, 0)
            at_least({**{x("sign", u, s): 1 for u in nbrs[w] | {w}}, reveal: -t}, 0)
    seed = {x("reveal", 0, s): 1 for s in range(stories)}  # v's own share of its seed
    for w in nbrs[0]:
        for s in range(stories):
            y = x("seed", w, s)
            at_most({y: 1, x("reveal", w, s): -1}, 0)
            at_most({y: 1, x("src", w, 0): -1}, 0)
            at_most({y: 1, x("sign" if rule == "signed U3" else "in", *((0, s) if rule == "signed U3" else (s, 0))): -1}, 0)
            seed[y] = 1
    at_least(seed, t)
    for u in nbrs[0]:  # every source of v: t holders reveal its key (its story leaves it out)
        keys = {x("src", 0, u): -t}
        for w in nbrs[u]:
            for s in range(stories):
                y = x("key", w, s, u)
                at_most({y: 1, x("reveal", w, s): -1}, 0)
                at_most({y: 1, x("src", w, u): -1}, 0)
                at_most({y: 1, x("in", s, u): 1}, 1)
                keys[y] = 1
        at_least(keys, 0)
    a = np.zeros((len(rows), len(index)))
    for i, (coeffs, _, _) in enumerate(rows):
        for j, value in coeffs.items():
            a[i, j] += value
    result = milp(np.zeros(len(index)), integrality=np.ones(len(index)), bounds=Bounds(0, 1),
                  constraints=LinearConstraint(a, [lo for _, lo, _ in rows], [hi for _, _, hi in rows]))
    assert result.status in (0, 2), result.message
    return result.status == 0


if __name__ == "__main__":
    for n, k, t in [(9, 8, 5), (10, 4, 3), (14, 4, 3), (12, 6, 4), (16, 8, 5), (20, 8, 5), (24, 8, 6)]:
        found = {rule: attack_exists(n, k, t, rule) for rule in ("in U3", "signed U3")}
        print(f"n={n} k={k} t={t}: " + "; ".join(f"seed share if {rule}: {'ATTACK' if hit else 'none'}"
                                                 for rule, hit in found.items()), flush=True)
