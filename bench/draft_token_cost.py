"""What a drafted token costs, as a share of one decoding step: the ratio behind the Lookahead Cache's
per-device `draft_token_cost` defaults (engine_worker/core/lookahead/acceptance.py).

A step that verifies k drafted tokens runs the model on 1 + k query tokens per sequence instead of 1,
over the same KV cache. This times one forward pass of a Llama-shaped decoder (random weights; the
cost depends on the shapes alone) with a static KV cache of --context tokens per sequence, for query
lengths 1 and 1 + k, at several batch sizes B, and reports a drafted token's cost as a share of that
batch's plain step:

    cost per drafted token = (t(1 + k) - t(1)) / (k * B * t(1))

The drafting rule's bar at batch B is the default (batch 1's figure) times B, since an accepted token
saves only its own request's share of a step; where the figure here falls with B, that bar is cautious.

On a GPU every pass is captured in a CUDA graph and replayed, as vLLM runs decode steps, so that
Python's kernel launches do not hide the GPU's work; on a CPU the passes run eagerly. vLLM's own step
adds its scheduler and sampler around the pass, which makes a real step longer and the ratio a little
smaller than measured here: the figures are an upper bound, the cautious side for the drafting rule.

    python bench/draft_token_cost.py                 # CPU: the bundled model's shape, float32
    python bench/draft_token_cost.py --device cuda   # adds an 8B shape, bfloat16

Writes bench/results/draft_token_cost.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int


SHAPES = {
    "smollm2-135m": Shape("smollm2-135m", layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536),
    "llama-8b": Shape("llama-8b", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336),
}


class Decoder:
    """The shapes of a Llama decoder's forward pass over a static KV cache (no rotary embedding and
    no vocabulary projection: neither changes with the number of query tokens enough to matter)."""

    def __init__(self, shape: Shape, batch: int, context: int, query: int, dtype: torch.dtype, device: str):
        self.shape, self.batch, self.context, self.query = shape, batch, context, query
        self.head_dim = shape.hidden // shape.heads
        kv_width = shape.kv_heads * self.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, dtype=dtype, device=device) * 0.02

        self.layers = [(weight(shape.hidden + 2 * kv_width, shape.hidden), weight(shape.hidden, shape.hidden),
                        weight(2 * shape.intermediate, shape.hidden), weight(shape.hidden, shape.intermediate))
                       for _ in range(shape.layers)]
        total = context + query
        self.keys = [torch.randn(batch, shape.kv_heads, total, self.head_dim, dtype=dtype, device=device)
                     for _ in range(shape.layers)]
        self.values = [torch.randn_like(k) for k in self.keys]
        # The query tokens see the whole context and, among themselves, only earlier ones.
        mask = torch.ones(query, total, dtype=torch.bool, device=device)
        mask[:, context:] = torch.ones(query, query, dtype=torch.bool, device=device).tril()
        self.mask = mask
        self.hidden = torch.randn(batch, query, shape.hidden, dtype=dtype, device=device)

    def forward(self) -> torch.Tensor:
        s, b, q, d = self.shape, self.batch, self.query, self.head_dim
        x = self.hidden
        for (qkv_w, out_w, up_w, down_w), keys, values in zip(self.layers, self.keys, self.values, strict=True):
            h = F.rms_norm(x, (s.hidden,))
            qkv = h @ qkv_w.t()
            queries = qkv[..., :s.hidden].view(b, q, s.heads, d).transpose(1, 2)
            new = qkv[..., s.hidden:].view(b, q, 2, s.kv_heads, d)
            keys[:, :, self.context:].copy_(new[:, :, 0].transpose(1, 2))
            values[:, :, self.context:].copy_(new[:, :, 1].transpose(1, 2))
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask, enable_gqa=True)
            x = x + attended.transpose(1, 2).reshape(b, q, s.hidden) @ out_w.t()
            gate, up = (F.rms_norm(x, (s.hidden,)) @ up_w.t()).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ down_w.t()
        return x


def time_pass(decoder: Decoder, device: str, repeats: int) -> float:
    """Median seconds of one forward pass."""
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up before capture, as CUDA graphs require
            for _ in range(3):
                decoder.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decoder.forward()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        return statistics.median(times)
    with torch.inference_mode():
        decoder.forward()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            decoder.forward()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--context", type=int, default=1024, help="KV-cache tokens per sequence (default 1024)")
    parser.add_argument("--drafts", default="4,8", help="drafted tokens per sequence, comma-separated (default 4,8)")
    parser.add_argument("--batches", default="1,4,16", help="batch sizes, comma-separated (default 1,4,16)")
    parser.add_argument("--repeats", type=int, default=0, help="timed passes each (default 50 on cuda, 5 on cpu)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "draft_token_cost.json")
    args = parser.parse_args()
    try:
        drafts = [int(k) for k in args.drafts.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error("--drafts and --batches take comma-separated whole numbers")
    if min(drafts + batches) < 1 or args.context < 1:
        parser.error("--context, --drafts and --batches must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    repeats = args.repeats or (50 if args.device == "cuda" else 5)
    torch.manual_seed(0)
    if args.device == "cpu":
        shapes, dtype = [SHAPES["smollm2-135m"]], torch.float32
    else:
        shapes, dtype = list(SHAPES.values()), torch.bfloat16
    rows = []
    for shape in shapes:
        for batch in batches:
            base = time_pass(Decoder(shape, batch, args.context, 1, dtype, args.device), args.device, repeats)
            for k in drafts:
                verify = time_pass(Decoder(shape, batch, args.context, 1 + k, dtype, args.device), args.device,
                                   repeats)
                row = {"shape": shape.name, "batch": batch, "drafted_per_sequence": k,
                       "step_ms": round(base * 1000, 4), "verify_step_ms": round(verify * 1000, 4),
                       "cost_per_drafted_token": round((verify - base) / (k * batch * base), 4)}
                rows.append(row)
                print(f"{shape.name:13s} batch {batch:3d} k={k:2d}: step {row['step_ms']:8.3f} ms, with drafts "
                      f"{row['verify_step_ms']:8.3f} ms, a drafted token costs {row['cost_per_drafted_token']:.4f} "
                      "of a step", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": args.device, "device_name": device_name, "dtype": str(dtype), "context": args.context,
              "cuda_graphs": args.device == "cuda", "torch": torch.__version__,
              "shapes": {s.name: asdict(s) for s in shapes}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
