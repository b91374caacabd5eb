"""Rebuilt shards (quality_sweep's build_shards) against the pipeline's own shard states (ref.pt:
the first samples of shard 0 as the eyas-local server dumped them), and the FP8 shard against
both."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eyas.extraction.shards import ShardReader

ref = torch.load(sys.argv[1])
out = {}
for enc, folder in (("plain", sys.argv[2]), ("fp8_e4m3", sys.argv[3])):
    r = ShardReader(Path(folder) / "shard-00000.safetensors")
    same = tot = 0
    rel = []
    for i, (a, last) in enumerate(zip(ref["aux"], ref["last"])):
        s = r.sample(i)
        for x, y in ((s.aux_hidden_states, a), (s.last_hidden_state, last)):
            same += int((x == y).sum())
            tot += x.numel()
            rel.append(float((x.float() - y.float()).norm() / y.float().norm()))
    out[enc] = {
        "encoding": r.encoding,
        "bit_identical_frac": round(same / tot, 6),
        "max_rel_err": max(rel),
    }
print("REFCHECK", json.dumps(out))
