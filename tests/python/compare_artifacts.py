"""compare_artifacts.py A B TOL: two mapper folders hold the same selections and weights within TOL."""
import sys

import numpy as np

from crosskv_read import read_mapper

a_dir, b_dir, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
ma, la = read_mapper(a_dir)
mb, lb = read_mapper(b_dir)
assert len(la) == len(lb), "different number of layers"
worst = 0.0
for x, y, ta, tb in zip(ma["layers"], mb["layers"], la, lb):
    assert x["source_layers"] == y["source_layers"], f"layer {x['target_layer']}: selections differ"
    for name in ("k.weight", "k.bias", "v.weight", "v.bias"):
        scale = max(1.0, float(np.abs(ta[name]).max()))
        worst = max(worst, float(np.abs(ta[name] - tb[name]).max()) / scale)
print(f"max relative difference {worst:.3g} (tolerance {tol:g})")
sys.exit(0 if worst <= tol else 1)
