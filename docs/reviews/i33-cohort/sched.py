"""Brute force: eligible() never changes a scheduler's decisions or state (min-sep, fixed-epoch), and
eligible(t, A) equals the number of A the round could select (min-sep: |{s in A: allowed}|, checked
against an independent re-implementation of MinSep(b, k); fixed-epoch: slot members in A)."""
import random

from fedmf.schedule import FixedEpochOrder, MinSepSelection


def indep_allowed(hist, t, b, k, users):
    out = 0
    for u in users:
        h = [r for r in hist.get(u, [])]
        if not h or (t - h[-1] >= b and (k is None or len(h) < k)):
            out += 1
    return out

rng = random.Random(1)
cases = 0
for trial in range(300):
    n = rng.randint(1, 12); b = rng.randint(1, 4); k = rng.choice([None, 1, 2, 3]); m = rng.randint(1, 5)
    key = bytes(rng.randrange(256) for _ in range(32))
    users = [f"u{i}" for i in range(n)]
    a, p = MinSepSelection(b, k, m, key), MinSepSelection(b, k, m, key)
    hist = {}
    for t in range(10):
        avail = [u for u in users if rng.random() < 0.7]
        for _ in range(3):  # ask about random sets, including bogus round numbers
            probe = [u for u in users if rng.random() < 0.5] + ["ghost"]
            e = a.eligible(rng.choice([t, t + 1, t + 5]), probe)
        assert a.eligible(t, avail) == indep_allowed(hist, t, b, k, avail)
        e = a.eligible(t, avail)
        sa, sp = a.select(t, avail), p.select(t, avail)
        assert sa == sp and a.state_dict() == p.state_dict()
        assert len(sa.selected) == min(m, e), (len(sa.selected), m, e)
        for u in sa.selected:
            hist.setdefault(u, []).append(t)
        cases += 1
    # fixed epoch
    b2, ep = rng.randint(1, 4), rng.randint(1, 3)
    f, g = FixedEpochOrder(b2, ep, users, key), FixedEpochOrder(b2, ep, users, key)
    for t in range(b2 * ep):
        avail = [u for u in users if rng.random() < 0.6]
        for _ in range(3):
            f.eligible(rng.randrange(b2 * ep + 3), [u for u in users if rng.random() < 0.5])
        e = f.eligible(t, avail)
        sf, sg = f.select(t, avail), g.select(t, avail)
        assert sf == sg and f.state_dict() == g.state_dict()
        assert len(sf.reachable) == e, (len(sf.reachable), e)
        cases += 1
    assert f.eligible(b2 * ep, users) is None
print("scheduler brute force OK:", cases, "rounds")
