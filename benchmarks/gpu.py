"""GPU check of the fused capture: GPT-2 small (124M) in bf16 autocast with AdamW, fused and foreach.

    python benchmarks/gpu.py                 # on a CUDA machine; about 3 minutes
    python benchmarks/gpu.py --device cpu --layers 1 --width 64 --vocab 512 --seq 32 --steps 10   # smoke run

For each AdamW implementation (``fused=True``, ``foreach=True``) and each mode (plain, eager
every=1, fused every=1, fused every=10), after warm-up (the fused graphs compile there, and the
compile time is printed): the mean iteration time (forward, backward, step) as a ratio to plain,
the kernels launched by one logging step beyond the plain step's (``torch.profiler``, CUDA
activity), and the host syncs of one logging step (``torch.cuda.set_sync_debug_mode("warn")``
turns each synchronizing call into a warning, which is counted).

Then the clone fallback's device memory: a third-party optimizer without a view (sign SGD, defined
tests/thirdparty.py), plain and monitored with every=1, on the same model: the peak device memory of one step
beyond the memory held before it (``torch.cuda.max_memory_allocated``), as a share of the
parameter bytes. Snapshots are staged through pinned host memory, so a logging step should hold a
chunk more than the plain step, not a copy of the model.
"""

from __future__ import annotations

import argparse
import sys
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from monitored_optim import Monitored, MonitorConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from thirdparty import SignSGD  # noqa: E402  (an optimizer the monitor has no view for)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        x = x + self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 small's shapes: 50257 x 768 embedding (tied head), 1024 positions, 12 blocks, 12 heads."""

    def __init__(self, layers: int = 12, width: int = 768, vocab: int = 50257) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(1024, width)
        self.h = nn.ModuleList(Block(width, 12 if width % 12 == 0 else 4) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def build(impl: str, mode: str, args: argparse.Namespace):
    torch.manual_seed(0)
    model = GPT2(args.layers, args.width, args.vocab).to(args.device)
    flags = {impl: True} if args.device == "cuda" else {}
    if mode == "plain":
        opt = torch.optim.AdamW(model.named_parameters(), lr=6e-4, weight_decay=0.1, **flags)
    else:
        capture, every = mode.split(" every=")
        opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=6e-4, weight_decay=0.1, **flags,
                                           monitor=MonitorConfig(backend="none", every=int(every),
                                                                 compile=capture == "fused"))
    return model, opt


def iteration(model, opt, tokens) -> None:
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kernels_and_syncs(model, opt, tokens, device: str) -> tuple[int, int]:
    """Kernels launched and host syncs of one ``opt.step()`` (grads already computed)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    opt.zero_grad(set_to_none=True)
    logits.float().square().mean().backward()
    _sync(device)
    activities = [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [torch.profiler.ProfilerActivity.CPU]
    with warnings.catch_warnings(record=True) as caught, torch.profiler.profile(activities=activities) as prof:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        opt.step()
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        _sync(device)
    kinds = (torch.autograd.DeviceType.CUDA,) if device == "cuda" else (torch.autograd.DeviceType.CPU,)
    launched = sum(1 for e in prof.events()
                   if e.device_type in kinds and (device != "cpu" or e.name.startswith("aten::")))
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message))
    return launched, syncs


def fallback_memory(args: argparse.Namespace, tokens: torch.Tensor) -> None:
    """Peak device bytes of one optimizer step beyond those held before it, plain and monitored."""
    if args.device != "cuda":
        print("clone fallback: device memory is measured on CUDA only")
        return
    print(f"{'sign SGD (no view)':<22} {'step peak beyond held, % of parameter bytes':>44}")
    for name, cls, extra in (("plain", SignSGD, {}),
                             ("monitored every=1", Monitored(SignSGD),
                              {"monitor": MonitorConfig(backend="none", every=1)})):
        torch.manual_seed(0)
        model = GPT2(args.layers, args.width, args.vocab).to(args.device)
        opt = cls(model.named_parameters(), **extra)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        peaks = []
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            logits = model(tokens[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            del logits
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - held)
        print(f"{name:<22} {100 * max(peaks) / nbytes:>43.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=args.device)
    print(f"torch {torch.__version__}, {args.device}"
          f"{' ' + torch.cuda.get_device_name() if args.device == 'cuda' else ''}, {args.layers} blocks of width "
          f"{args.width}, vocabulary {args.vocab}")
    modes = ["plain", "eager every=1", "fused every=1", "fused every=10"]
    for impl in ("fused", "foreach"):
        runs = {m: build(impl, m, args) for m in modes}
        for m in modes:  # warm-up; the first fused logging step compiles
            _sync(args.device)
            start = time.perf_counter()
            iteration(*runs[m], tokens)
            _sync(args.device)
            if m == "fused every=1":
                print(f"AdamW {impl}: first fused logging step {time.perf_counter() - start:.1f} s")
            for _ in range(9):
                iteration(*runs[m], tokens)
        times = {m: [] for m in modes}
        for _ in range(max(1, args.steps // 10)):
            for m in modes:  # interleaved rounds of ten iterations
                _sync(args.device)
                start = time.perf_counter()
                for _ in range(10):
                    iteration(*runs[m], tokens)
                _sync(args.device)
                times[m].append((time.perf_counter() - start) / 10)
        plain = statistics.median(times["plain"])
        base = kernels_and_syncs(*runs["plain"], tokens, args.device)
        print(f"{'mode':<16} {'iteration / plain':>18} {'kernels beyond plain':>21} {'host syncs':>11}")
        for m in modes:
            launched, syncs = kernels_and_syncs(*runs[m], tokens, args.device) if m != "fused every=10" else base
            note = " (a non-logging step)" if m == "fused every=10" else ""
            print(f"{m:<16} {statistics.median(times[m]) / plain:>18.3f} {launched - base[0]:>21} {syncs:>11}{note}")
        print(f"plain iteration {plain * 1e3:.1f} ms; parameters "
              f"{sum(p.numel() for p in runs['plain'][0].parameters()) / 1e6:.1f} M "
              f"({sum(1 for _ in runs['plain'][0].parameters())} tensors)")
    fallback_memory(args, tokens)


if __name__ == "__main__":
    main()
