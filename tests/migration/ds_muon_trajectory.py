"""Run with DeepSpeed 0.19.8 importable (the test anchor) and zeroengine: DeepSpeed's Muon math against
zeroengine's on the same inputs, in fp32, printed as one JSON line (tests/distributed/test_deepspeed_checkpoints.py
style: the anchor never enters the test process).

* each Newton-Schulz function and ``muon_update`` on wide, tall and square matrices, gram and standard, and the
  per-head orthogonalisation of ``per_head_muon``;
* three steps of DeepSpeed's SingleDeviceMuonWithAuxAdam (what its stage 0 steps) against zeroengine's Muon on
  whole tensors, a Muon matrix and an Adam vector.

DeepSpeed compiles these functions with torch.compile; the eager originals are what is compared (compiling
changes the rounding of fused ops, not the math), with its Newton-Schulz dtype pinned to fp32 (it picks fp16 for
"gram" where oneDNN has fp16, and bf16 for "standard"; zeroengine picks the same, see ns_compute_dtype)."""
import json

import torch
from deepspeed.runtime.zero.muon import original_muon as ds

from zeroengine.optim import muon as ze

for name in ("zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz", "muon_update"):
    setattr(ds, name, getattr(getattr(ds, name), "_torchdynamo_orig_callable", getattr(ds, name)))
ds.ns_compute_dtype = lambda method="gram": torch.float32

out = {}
g = torch.Generator().manual_seed(0)
for shape in ((8, 20), (20, 8), (12, 12)):
    G = torch.randn(shape, generator=g)
    out[f"gram{shape}"] = (ds.zeropower_via_gram_newtonschulz(G, 5) - ze.gram_newton_schulz(G, 5)).abs().max().item()
    out[f"standard{shape}"] = (ds.zeropower_via_newtonschulz5(G, 5) - ze.newton_schulz(G, 5)).abs().max().item()
    for method in ("gram", "standard"):
        grad, buf = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        want = ds.muon_update(grad.clone(), buf.clone(), beta=0.9, ns_method=method)
        buf.lerp_(grad, 0.1)
        got = ze.orthogonalize(grad.clone().lerp_(buf, 0.9), method, dtype=torch.float32)
        out[f"muon_update_{method}{shape}"] = (want - got).abs().max().item()

for heads, shape in ((4, (32, 20)), (2, (16, 40))):  # per_head_muon: [heads * head_dim, in]
    U = torch.randn(shape, generator=g)
    for method in ("gram", "standard"):
        want = ds._per_head_orthogonalize(U.clone(), heads, 5, method)
        got = ze.orthogonalize(U.clone(), method, dtype=torch.float32, num_heads=heads)
        out[f"per_head_{method}{shape}"] = (want - got).abs().max().item()

w0, b0 = torch.randn(12, 20, generator=g), torch.randn(12, generator=g)
grads = [(torch.randn(12, 20, generator=g), torch.randn(12, generator=g)) for _ in range(3)]
runs = []
for make in (lambda groups: ds.SingleDeviceMuonWithAuxAdam(groups), lambda groups: ze.Muon(groups)):
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    opt = make([{"params": [w], "use_muon": True, "lr": 0.02, "momentum": 0.95, "weight_decay": 0.01},
                {"params": [b], "use_muon": False, "lr": 3e-3, "weight_decay": 0.01}])
    if isinstance(opt, ze.Muon):
        opt.ns_dtype = torch.float32
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    runs.append((w.detach().clone(), b.detach().clone()))
out["trajectory_matrix"] = (runs[0][0] - runs[1][0]).abs().max().item()
out["trajectory_vector"] = (runs[0][1] - runs[1][1]).abs().max().item()
print("RESULT " + json.dumps(out))
