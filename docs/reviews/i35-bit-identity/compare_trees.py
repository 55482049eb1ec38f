"""Bit-identity of `fedmf simulate` across two source trees (issue 35: behaviour unchanged).

    python docs/reviews/i35-bit-identity/compare_trees.py OLD_TREE NEW_TREE [OUT_DIR]

Each configuration runs in each tree (PYTHONPATH selects it) with the same fixed secrets and the
test-only repeatable noise; the digests cover every tensor of every checkpoint and noise file (the
torch RNG state, seeded at random per process, left out) and results.json without times, paths and
the chain head (which hashes commit times). b-min-sep sampling's Monte Carlo ε is seeded per plan
since issue 35 (random before), so that row may differ from a tree before it."""

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CASES = [
    "--preset tiny --rounds 6",
    "--preset tiny --rounds 6 --mechanism banded-toeplitz --bands 3",
    "--preset tiny --rounds 6 --mechanism dp-sgd --sampling cyclic-poisson:0.5",
    "--preset tiny --rounds 6 --adaptive-clipping 0.5 --clip-norm 0.1 --adaptive-clipping-count-noise 6",
    "--preset tiny --rounds 6 --client-metrics private --client-metrics-noise 50 --mechanism blt",
    "--preset tiny --rounds 6 --sampling bminsep:0.5 --mechanism bsr",
]
DROP = {"seconds", "seconds_total", "out_dir", "ledger", "audit", "chain_head"}


def run(tree: Path, args: str, out: Path, label: str) -> None:
    out.mkdir(mode=0o700, parents=True)
    (out / "secrets").mkdir(mode=0o700)
    for name in ("noise_seed", "schedule_key", "ledger_secret"):
        fd = os.open(out / "secrets" / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, hashlib.sha256(f"compare-trees/{label}/{name}".encode()).digest())
        os.close(fd)
    env = {**os.environ, "PYTHONPATH": str(tree), "FEDMF_UNSAFE_REPEATABLE_NOISE": "1",
           "FEDMF_CACHE_DIR": str(out / "cache")}
    subprocess.run([sys.executable, "-m", "fedmf.cli", "simulate", *args.split(), "--out", str(out),
                    "--witness", "off", "--quiet", "--no-plot"], cwd=tree, env=env, check=True,
                   capture_output=True)


def digest(out: Path) -> tuple[str, str]:
    h = hashlib.sha256()

    def walk(o):
        if isinstance(o, torch.Tensor):
            h.update(o.contiguous().view(torch.uint8).numpy().tobytes() if o.numel() else b"")
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)

    for p in sorted(out.rglob("*.pt")):
        obj = torch.load(p, map_location="cpu", weights_only=False)
        if isinstance(obj, dict) and isinstance(obj.get("state"), dict):
            obj = {**obj, "state": {k: v for k, v in obj["state"].items() if k != "rng"}}
        walk(obj)
    res = json.loads((out / "results.json").read_text())
    keep = {k: ([{a: b for a, b in r.items() if a != "seconds"} for r in v] if k == "history" else v)
            for k, v in res.items() if k not in DROP}
    return h.hexdigest()[:16], hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main() -> int:
    old, new = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    root = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp(prefix="fedmf-compare-"))
    same = True
    for i, args in enumerate(CASES):
        digests = []
        for name, tree in (("old", old), ("new", new)):
            out = root / name / f"run{i}"
            run(tree, args, out, str(i))
            digests.append(digest(out))
        equal = digests[0] == digests[1]
        same &= equal or "bminsep" in args
        print(f"{'identical' if equal else 'DIFFERENT'}  {args}  old {digests[0]}  new {digests[1]}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
