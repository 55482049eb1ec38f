"""An adaptive, salted train() run with client metrics; every secret file (mode 0600 outside checkpoints) is read
and its bytes (raw, hex, base64) searched for in every other file of the run directory and in the captured
stderr.   PYTHONPATH=$PWD python docs/reviews/i35-clipping/secrets_scan.py"""
import base64
import contextlib
import io
import os
import stat
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_e2e import fake_secrets, run

with tempfile.TemporaryDirectory() as d:
    fake_secrets()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        run(True, torch.float32, True, True, directory=d)
    files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
    secret_files = [f for f in files if stat.S_IMODE(os.stat(f).st_mode) == 0o600 and "secret" in f.lower()]
    print("secret files:", [os.path.relpath(f, d) for f in secret_files])
    hits = 0
    for sf in secret_files:
        raw = Path(sf).read_bytes().strip()
        needles = [raw] + ([bytes.fromhex(raw.decode())] if all(c in b"0123456789abcdef" for c in raw) else [])
        needles += [n.hex().encode() for n in needles] + [base64.b64encode(n) for n in needles]
        needles = [n for n in needles if len(n) >= 16]
        for f in files:
            if f == sf:
                continue
            blob = Path(f).read_bytes()
            for n in needles:
                if n in blob:
                    hits += 1
                    print("HIT", os.path.relpath(sf, d), "in", os.path.relpath(f, d))
        if any(n.decode(errors="ignore") in err.getvalue() for n in needles):
            hits += 1
            print("HIT in stderr", os.path.relpath(sf, d))
    print("files scanned", len(files), "hits", hits)
