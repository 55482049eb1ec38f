"""Feasibility of HIGH-1 (REVIEW-i36-secagg.md) on a Harary ring, as a max-flow (networkx).

Target v = node 0 of a ring of n nodes, each linked to k/2 on each side. The server needs, for each
node v masked with (all of N(v), or t − 1 of them when it trims v's sources at collect), t holders
that call that node dropped; a holder w can call at most k + 1 − t of its neighbours dropped (it must
list ≥ t survivors, itself included). Feasible iff the max flow equals (targets × t).
Run: python docs/reviews/i36-secagg/lie_flow.py
"""

import itertools

import networkx as nx


def feasible(k: int, t: int, n: int, targets: set[int], v_helps: bool) -> bool:
    half = k // 2

    def nbrs(p: int) -> set[int]:
        return {(p + o) % n for o in range(-half, half + 1) if o}

    g = nx.DiGraph()
    for w in range(n):
        if w == 0 and not v_helps:
            continue
        g.add_edge("s", ("w", w), capacity=k + 1 - t)
        for u in nbrs(w) & targets:
            g.add_edge(("w", w), ("u", u), capacity=1)
    for u in targets:
        g.add_edge(("u", u), "T", capacity=t)
    return nx.maximum_flow_value(g, "s", "T") == len(targets) * t


if __name__ == "__main__":
    n = 30
    for k, t in [(4, 3), (6, 4), (8, 5), (8, 6), (8, 7), (10, 6)]:
        nv = {o % n for o in range(-(k // 2), k // 2 + 1) if o}
        every = feasible(k, t, n, nv, v_helps=True)
        trimmed = any(feasible(k, t, n, set(c), v_helps=False) for c in itertools.combinations(sorted(nv), t - 1))
        print(f"k={k} t={t}: all sources {'FEASIBLE' if every else 'no'}; t-1 sources {'FEASIBLE' if trimmed else 'no'}")
