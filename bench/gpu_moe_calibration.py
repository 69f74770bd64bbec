"""Measure the GEMM side of a step on a real GPU for the simulator's step-time model (not a test).

``sim/profiles.py`` prices the non-attention part of a step with two
roofline guesses it names as the least certain numbers of the model:

- ``PREFILL_MFU`` (0.25): the fraction of dense bf16 peak that MoE prefill
  reaches, which sets ``prefill_s_per_token``;
- the decode step's weight read (most of ``fixed_overhead_s``), priced at
  ``HBM_EFFICIENCY`` (0.65) of peak bandwidth.

This script runs one GPU's share of Qwen3-30B-A3B at tensor parallelism 4
(the ``qwen30b-a3b-h100`` profile) through every linear part of its 48
layers: the QKV and output projections, the router's gate and top-8 choice,
and the 128 experts as grouped GEMMs (tokens sorted by expert, then
``torch._grouped_mm``, the CUTLASS grouped kernel on Hopper; a padded
``bmm`` where that is missing). Each layer has weights of its own, so a
decode step reads what a real one reads. The forward pass of all layers is
captured in a CUDA graph, as vLLM runs decode, so launch gaps do not count.

Not in the figures: attention (measured by ``gpu_attention_calibration``),
the two all-reduces per layer of a TP4 replica (one GPU here), sampling and
the scheduler's CPU time. The routing is uniform at random, so every expert
gets about the same share of a chunk's tokens; a real router is less even,
which makes real grouped GEMMs somewhat slower.

``python3 -P bench/gpu_moe_calibration.py --json out.json`` (needs only torch;
on a CPU it runs a tiny model as a smoke check). docs/simulator.md records the
figures and what they imply for the profile's constants.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoeShape:
    """A MoE decoder's linear shapes, for one GPU of a tensor-parallel replica."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_intermediate: int
    vocab: int
    tp: int

    @property
    def qkv_out(self) -> int:
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim // self.tp

    @property
    def attn_out(self) -> int:
        return self.q_heads * self.head_dim // self.tp

    @property
    def inter(self) -> int:
        """Each expert's intermediate width on one GPU (vLLM shards experts by TP by default)."""
        return self.expert_intermediate // self.tp

    def flops_per_token(self) -> float:
        """Multiply-adds x 2 of one token through every layer's linear parts (lm head excluded)."""
        per_layer = (
            self.hidden * self.qkv_out
            + self.attn_out * self.hidden
            + self.hidden * self.experts
            + self.top_k * (self.hidden * 2 * self.inter + self.inter * self.hidden)
        )
        return 2.0 * per_layer * self.layers

    def weight_bytes(self, bytes_per_param: int = 2) -> int:
        """Bytes of every layer's weights on one GPU (a decode step of a large batch reads them all)."""
        per_layer = (
            self.hidden * self.qkv_out
            + self.attn_out * self.hidden
            + self.hidden * self.experts
            + self.experts * 3 * self.hidden * self.inter
        )
        return per_layer * self.layers * bytes_per_param


# Qwen3-30B-A3B's config.json: 48 layers, hidden 2048, 32 query heads, 4 KV heads of 128 dims,
# 128 experts with top-8 routing, moe_intermediate_size 768, vocabulary 151,936; TP4 as in the profile.
QWEN30B_TP4 = MoeShape("qwen30b-a3b-tp4", 48, 2048, 32, 4, 128, 128, 8, 768, 151936, 4)
# A tiny model with the same structure, for the CPU smoke check.
TINY = MoeShape("tiny", 2, 64, 4, 2, 16, 8, 2, 64, 256, 1)


class Model:
    """Random weights of every layer, and the forward pass of their linear parts."""

    def __init__(self, shape: MoeShape, device: str, dtype: torch.dtype, mode: str) -> None:
        self.s = shape
        self.mode = mode  # "grouped", "bmm" (experts padded to one capacity) or "loop"
        self.capacity = 0  # tokens per expert in "bmm" mode: the most any expert got, set by size_capacity
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims: int) -> torch.Tensor:
            return torch.randn(*dims, device=device, dtype=dtype, generator=g) * dims[-1] ** -0.5

        s = shape
        self.layers = [
            {
                "qkv": w(s.qkv_out, s.hidden),
                "o": w(s.hidden, s.attn_out),
                "gate": w(s.experts, s.hidden),
                "w13": w(s.experts, 2 * s.inter, s.hidden),  # [E, out, in], as checkpoints store it
                "w2": w(s.experts, s.hidden, s.inter),
            }
            for _ in range(s.layers)
        ]
        self.lm_head = w(s.vocab // s.tp, s.hidden)

    def experts(self, h: torch.Tensor, lw: dict[str, torch.Tensor]) -> torch.Tensor:
        s = self.s
        logits = F.linear(h, lw["gate"])
        weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), s.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat)
        token_of = order // s.top_k
        xs = h.index_select(0, token_of)
        counts = torch.zeros(s.experts, device=h.device, dtype=torch.int32)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        if self.mode == "grouped":
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            up = torch._grouped_mm(xs, lw["w13"].transpose(-2, -1), offs=offs)
            act = F.silu(up[:, : s.inter]) * up[:, s.inter :]
            down = torch._grouped_mm(act, lw["w2"].transpose(-2, -1), offs=offs)
        elif self.mode == "bmm":
            # Each expert's rows go to its own slot of a [experts, capacity] buffer; one batched GEMM each way.
            starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
            slot = flat[order] * self.capacity + torch.arange(flat.numel(), device=h.device) - starts[flat[order]]
            buf = h.new_zeros(s.experts * self.capacity, s.hidden).index_copy_(0, slot, xs)
            up = torch.bmm(buf.view(s.experts, self.capacity, s.hidden), lw["w13"].transpose(-2, -1))
            act = F.silu(up[..., : s.inter]) * up[..., s.inter :]
            down = torch.bmm(act, lw["w2"].transpose(-2, -1)).reshape(-1, s.hidden).index_select(0, slot)
        else:
            # One matrix per expert in a loop: the fallback when no grouped kernel exists.
            ends = torch.cumsum(counts, 0).tolist()
            parts, start = [], 0
            for e, end in enumerate(ends):
                up = F.linear(xs[start:end], lw["w13"][e])
                act = F.silu(up[:, : s.inter]) * up[:, s.inter :]
                parts.append(F.linear(act, lw["w2"][e]))
                start = end
            down = torch.cat(parts)
        down = down * weights.reshape(-1)[order].unsqueeze(1).to(down.dtype)
        if self.sizing:
            self.most_routed = max(self.most_routed, int(counts.max().item()))
        return torch.zeros_like(h).index_add_(0, token_of, down)

    sizing = False
    most_routed = 0

    def size_capacity(self, x: torch.Tensor) -> None:
        """Set "bmm" mode's capacity to the most tokens any expert gets on ``x`` (an eager pass; the
        routing of a fixed input repeats exactly), rounded up to 16 rows."""
        if self.mode != "bmm":
            return
        self.capacity, self.sizing, self.most_routed = x.shape[0] * self.s.top_k, True, 0
        try:
            self.forward(x, 1)
        finally:
            self.sizing = False
        self.capacity = -(-self.most_routed // 16) * 16

    def forward(self, x: torch.Tensor, sampled: int) -> torch.Tensor:
        s = self.s
        for lw in self.layers:
            h = F.rms_norm(x, (s.hidden,))
            qkv = F.linear(h, lw["qkv"])
            # Attention itself is priced elsewhere; the output projection reads a slice of the same width.
            x = x + F.linear(qkv[:, : s.attn_out], lw["o"])
            x = x + self.experts(F.rms_norm(x, (s.hidden,)), lw)
        return F.linear(x[-sampled:], self.lm_head)


def timed(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after warm-up (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    samples = []
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


def runner(
    model: Model, tokens: int, sampled: int, device: str, dtype: torch.dtype, graph: bool
) -> tuple[Callable[[], object], bool]:
    """A call that runs the forward pass on ``tokens`` tokens: a CUDA graph replay where capture works."""
    x = torch.randn(tokens, model.s.hidden, device=device, dtype=dtype)
    model.size_capacity(x)
    if not graph:
        return (lambda: model.forward(x, sampled)), False
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model.forward(x, sampled)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model.forward(x, sampled)
        return g.replay, True
    except Exception as exc:  # any capture failure falls back to eager, and says so
        print(f"  CUDA graph capture failed ({type(exc).__name__}: {exc}); timing eagerly")
        torch.cuda.synchronize()
        return (lambda: model.forward(x, sampled)), False


def check_mode(shape: MoeShape, mode: str, device: str, dtype: torch.dtype) -> str | None:
    """None if ``mode``'s experts give the per-expert loop's answer on this device, else why not."""
    if mode == "grouped" and not hasattr(torch, "_grouped_mm"):
        return "torch has no _grouped_mm"
    small = MoeShape("check", 1, shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim,
                     shape.experts, shape.top_k, shape.expert_intermediate, shape.tp * 8, shape.tp)
    try:
        tried, loop = Model(small, device, dtype, mode), Model(small, device, dtype, "loop")
        loop.layers = tried.layers
        x = torch.randn(64, small.hidden, device=device, dtype=dtype)
        tried.size_capacity(x)
        a, b = tried.experts(x, tried.layers[0]), loop.experts(x, tried.layers[0])
        if not torch.allclose(a.float(), b.float(), rtol=5e-2, atol=5e-2):
            return f"{mode} and loop disagree (max diff {(a - b).abs().max().item():.3g})"
    except Exception as exc:  # reported; the mode is then not timed
        return f"{type(exc).__name__}: {exc}"
    return None


def reference_points(device: str, dtype: torch.dtype, reps: int, cuda: bool) -> dict[str, float]:
    """This device's own ceilings: a large dense GEMM and a device-to-device copy."""
    n = 8192 if cuda else 256
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    gemm = timed(lambda: a @ b, reps, cuda)
    src = torch.empty(2**31 if cuda else 2**22, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = timed(lambda: dst.copy_(src), reps, cuda)
    return {"gemm_tflops": 2.0 * n**3 / gemm / 1e12, "copy_tb_per_s": 2.0 * src.numel() / copy / 1e12}


def graphed(fn: Callable[[], object], cuda: bool) -> Callable[[], object]:
    """``fn`` captured as a CUDA graph (replayed by the returned call); ``fn`` itself on a CPU."""
    if not cuda:
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def parts(model: Model, tokens: int, device: str, dtype: torch.dtype, reps: int, cuda: bool) -> dict[str, float]:
    """Seconds of the pass's pieces over all layers, each on its own: the dense GEMMs (QKV, output,
    gate) and the experts' two grouped GEMMs on tokens already sorted by expert (with and without
    the activation between them). What the whole pass takes beyond these is routing, permutation
    and element-wise work, which vLLM's fused MoE kernels do in fewer launches."""
    s = model.s
    x = torch.randn(tokens, s.hidden, device=device, dtype=dtype)
    chosen = torch.topk(torch.rand(tokens, s.experts, device=device), s.top_k, dim=-1).indices.reshape(-1)
    counts = torch.zeros(s.experts, device=device, dtype=torch.int32)
    counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x.index_select(0, torch.argsort(chosen) // s.top_k)

    def dense() -> None:
        for lw in model.layers:
            F.linear(F.linear(x, lw["qkv"])[:, : s.attn_out], lw["o"])
            F.linear(x, lw["gate"])

    def experts(activation: bool) -> Callable[[], None]:
        def run() -> None:
            for lw in model.layers:
                up = torch._grouped_mm(xs, lw["w13"].transpose(-2, -1), offs=offs)
                act = F.silu(up[:, : s.inter]) * up[:, s.inter :] if activation else up[:, : s.inter].contiguous()
                torch._grouped_mm(act, lw["w2"].transpose(-2, -1), offs=offs)
        return run

    return {
        "dense_s": timed(graphed(dense, cuda), reps, cuda),
        "experts_gemm_s": timed(graphed(experts(False), cuda), reps, cuda),
        "experts_gemm_act_s": timed(graphed(experts(True), cuda), reps, cuda),
    }


def _timed_parts(model: Model, tokens: int, device: str, dtype: torch.dtype, reps: int, cuda: bool) -> dict[str, float]:
    out = parts(model, tokens, device, dtype, reps, cuda)
    print(f"    parts: dense {1e3 * out['dense_s']:.3f} ms, expert GEMMs {1e3 * out['experts_gemm_s']:.3f} ms "
          f"({1e3 * out['experts_gemm_act_s']:.3f} with the activation)")
    return out


def measure(model: Model, device: str, dtype: torch.dtype, reps: int, cuda: bool) -> dict[str, list[dict]]:
    shape = model.s
    prefill_chunks = [512, 2048, 8192] if cuda else [64]
    decode_batches = [16, 64, 128, 256, 512] if cuda else [4]
    result: dict[str, list[dict]] = {"prefill": [], "decode": []}
    for n in prefill_chunks:
        fn, graphed = runner(model, n, 1, device, dtype, cuda)
        secs = timed(fn, reps, cuda)
        row = {"tokens": n, "seconds": secs, "graph": graphed, "s_per_token": secs / n,
               "tflops": shape.flops_per_token() * n / secs / 1e12}
        if model.mode == "grouped":
            row.update(_timed_parts(model, n, device, dtype, reps, cuda))
        result["prefill"].append(row)
        print(f"  prefill chunk {n:5d}: {1e3 * secs:8.3f} ms  {1e6 * secs / n:6.3f} us/token  "
              f"{row['tflops']:6.1f} TFLOP/s  graph={graphed}")
    for b in decode_batches:
        fn, graphed = runner(model, b, b, device, dtype, cuda)
        secs = timed(fn, reps, cuda)
        row = {"batch": b, "seconds": secs, "graph": graphed, "tb_per_s": shape.weight_bytes() / secs / 1e12}
        if model.mode == "grouped":
            row.update(_timed_parts(model, b, device, dtype, reps, cuda))
        result["decode"].append(row)
        print(f"  decode batch {b:4d}: {1e3 * secs:8.3f} ms per step  "
              f"{row['tb_per_s']:5.2f} TB/s of weights  graph={graphed}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.bfloat16)
    shape = QWEN30B_TP4 if cuda else TINY
    out: dict[str, object] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "shape": asdict(shape),
        "flops_per_token": shape.flops_per_token(),
        "weight_bytes": shape.weight_bytes(),
        "reference": reference_points(device, dtype, args.reps, cuda),
        "modes": {},
    }
    print(f"device {out['device']}, torch {out['torch']}, reference {out['reference']}")
    print(f"== {shape.name}: {shape.layers} layers, {shape.flops_per_token() / 1e9:.3f} GFLOP per token, "
          f"{shape.weight_bytes() / 1e9:.2f} GB of weights per GPU")
    model: Model | None = None
    for mode in ("grouped", "bmm"):
        problem = check_mode(shape, mode, device, dtype)
        print(f"{mode}: {'checked against the loop' if problem is None else problem}")
        if problem is not None:
            out["modes"][mode] = {"problem": problem}  # type: ignore[index]
            continue
        if model is None:
            model = Model(shape, device, dtype, mode)
        model.mode = mode
        out["modes"][mode] = measure(model, device, dtype, args.reps, cuda)  # type: ignore[index]
        if args.json:  # written after each mode, so a later failure keeps what was measured
            args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
