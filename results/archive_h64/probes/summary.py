"""The explorer learning-rate probes of pre-registration 2 (results/README.md): per probe, the means over A's 12
updates (4 cycles) of B's training success, A's, KL(B || A) on the replayed tokens and the clip centre's spread,
and the pre-registered choice: the largest --explorer-lr whose B success >= A's - 10 points.
Run: python results/probes/summary.py (each probe reruns from its command.txt, from the repository root)."""
import glob
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
rows = []
for d in glob.glob(os.path.join(HERE, "explorer_lr*")):
    records = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))][1:]   # line 0: the start
    mean = lambda k: float(np.mean([r[k] for r in records]))
    rows.append((float(d.split("explorer_lr")[1]), len(records), 100 * mean("explorer/success"),
                 100 * mean("train/success"), mean("buffer/explorer_kl"), mean("buffer/clip_centre_p10"),
                 mean("buffer/clip_centre_p90")))
print("| --explorer-lr | A updates | B success | A success | KL(B ‖ A) | clip centre p10 / p90 | qualifies |")
print("|---|---|---|---|---|---|---|")
for lr, n, b, a, kl, p10, p90 in sorted(rows):
    print(f"| {lr:g} | {n} | {b:.1f} | {a:.1f} | {kl:.4f} | {p10:.2f} / {p90:.2f} | {'yes' if b >= a - 10 else 'no'} |")
print("chosen:", max([r[0] for r in rows if r[2] >= r[3] - 10], default="none (1e-4 stays)"))
