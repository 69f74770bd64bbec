"""Measure attention costs on a real GPU for the simulator's step-time model (not a test).

The simulator prices a step linearly (``sim/step_time.py``). Two of its
constants are about attention and were derived by roofline arithmetic:

- reading KV during decode (bytes per token over achieved HBM bandwidth:
  ``HBM_EFFICIENCY`` in ``sim/profiles.py``), and
- the compute of prefill attention, which grows with the context a prompt
  chunk attends over (new tokens x context tokens), a cost a per-token
  prefill price misses for long agentic contexts.

This script times PyTorch's fused scaled-dot-product attention (flash or
cuDNN kernels) in bf16 with the attention shapes of the two GPU profiles, and
prints achieved FLOP/s for prefill over long contexts and achieved bytes/s
for decode. ``python -P -m misat_bench.gpu_attention_calibration --json out.json``;
docs/simulator.md records the figures and the constants taken from them.
Needs torch with a CUDA device; on CPU it runs tiny shapes as a smoke check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Attention shapes per profile (query heads, KV heads, head dim), per layer, one GPU of the replica.
SHAPES = {
    # Qwen3-30B-A3B: 32 query heads, 4 KV heads, head_dim 128; TP4 -> 8 q heads, 1 KV head per GPU.
    "qwen30b-a3b-tp4": (8, 1, 128),
    # The Step3.7-like profile's assumption (sim/profiles.py): one shared KV head of 256 dims,
    # 64 query heads; TP8 -> 8 q heads per GPU, the KV head replicated.
    "step3.7-tp8": (8, 1, 256),
}


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after warm-up (CUDA events when on GPU)."""
    for _ in range(3):
        fn()
    samples = []
    cuda = torch.cuda.is_available()
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def prefill_point(hq: int, hkv: int, d: int, new: int, context: int, dev: str, dt: torch.dtype, reps: int) -> dict:
    """A chunk of ``new`` tokens attending over ``context`` earlier tokens plus itself (no mask:
    the full rectangle, so the pair count is exact)."""
    q = torch.randn(1, hq, new, d, device=dev, dtype=dt)
    k = torch.randn(1, hkv, context + new, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    secs = timed(lambda: attention(q, k, v), reps)
    pairs = new * (context + new)
    flops = 4.0 * hq * d * pairs
    return {"new": new, "context": context, "seconds": secs, "pairs": pairs,
            "s_per_pair_per_layer": secs / pairs, "tflops": flops / secs / 1e12}


def decode_point(hq: int, hkv: int, d: int, batch: int, context: int, dev: str, dt: torch.dtype, reps: int) -> dict:
    q = torch.randn(batch, hq, 1, d, device=dev, dtype=dt)
    k = torch.randn(batch, hkv, context, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    secs = timed(lambda: attention(q, k, v), reps)
    kv_bytes = 2 * batch * hkv * context * d * k.element_size()
    return {"batch": batch, "context": context, "seconds": secs, "kv_tokens": batch * context,
            "s_per_kv_token_per_layer": secs / (batch * context), "tb_per_s": kv_bytes / secs / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    contexts = [0, 8192, 32768, 65536, 98304] if cuda else [0, 256]
    new = 2048 if cuda else 64
    decode = [(128, 4096), (128, 16384), (64, 65536)] if cuda else [(4, 256)]
    out: dict[str, object] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "profiles": {},
    }
    for name, (hq, hkv, d) in SHAPES.items():
        pre = [prefill_point(hq, hkv, d, new, c, dev, dt, args.reps) for c in contexts]
        dec = [decode_point(hq, hkv, d, b, c, dev, dt, args.reps) for b, c in decode]
        out["profiles"][name] = {"heads": [hq, hkv, d], "prefill": pre, "decode": dec}  # type: ignore[index]
        print(f"== {name}: q heads {hq}, kv heads {hkv}, head dim {d} (one layer, one GPU)")
        for p in pre:
            print(f"prefill {p['new']:5d} new over {p['context']:6d} context: {1e3 * p['seconds']:8.3f} ms "
                  f"{p['tflops']:7.1f} TFLOP/s  {1e12 * p['s_per_pair_per_layer']:.4f} ps/pair")
        for p in dec:
            print(f"decode batch {p['batch']:4d} x {p['context']:6d} context: {1e3 * p['seconds']:8.3f} ms "
                  f"{p['tb_per_s']:6.2f} TB/s  {1e12 * p['s_per_kv_token_per_layer']:.2f} ps/KV token")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
