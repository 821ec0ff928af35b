"""One-off: variants of the best-class max over RetinaNet's [16, 120087, 91] fp16 logits (kept in git history for its command)."""
import torch
x = torch.randn(16, 120087, 91, device="cuda", dtype=torch.float16)
ref = x.amax(dim=2)
def two_stage(t):
    m = torch.maximum(t[..., :45], t[..., 45:90])
    return torch.maximum(m.amax(dim=2), t[..., 90])
def halves(t):
    return torch.maximum(t[..., :46].amax(dim=2), t[..., 45:].amax(dim=2))
def pool(t):
    return torch.nn.functional.max_pool1d(t.view(1, -1, 91), 91).view(16, -1) if False else t.view(-1, 91).max(dim=1).values.view(16, -1)
def as_int(t):  # fp16 order as int16: not monotone for negatives; only for timing
    return t.view(torch.int16).amax(dim=2)
def transposed(t):
    return t.transpose(1, 2).amax(dim=1)
variants = {"amax": lambda t: t.amax(dim=2), "max.values": lambda t: t.max(dim=2).values, "two_stage": two_stage,
            "halves": halves, "view_max": pool, "float32 amax": lambda t: t.float().amax(dim=2), "transposed": transposed}
for name, f in variants.items():
    out = f(x)
    ok = torch.equal(out, ref)
    for _ in range(3):
        f(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(50):
        f(x)
    e.record(); torch.cuda.synchronize()
    print(f"{name:14s} {s.elapsed_time(e) / 50:.3f} ms  equal={ok}")
