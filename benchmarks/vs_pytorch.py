"""This framework's training step against the same model and optimiser in plain PyTorch, timed
interleaved in one process, on the shapes of issue 17.

    pip install torch==2.13.0      # an optional benchmark dependency (the `benchmark` extra), never a runtime one
    python benchmarks/vs_pytorch.py [--rounds 3] [--steps 5] [--shapes small medium t128 t512 t2048]

The model is GPT-2 style: learned positions, pre-LayerNorm, GELU (tanh) MLP of 4D, biases, tied
embeddings, no dropout; AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1 on everything), gradient
norm clipped to 1.0; float32. The vocabulary is the byte tokenizer's padded to 320 (what this
framework computes; the padding rows are masked out of its softmax, not out of PyTorch's). Batches
are random tokens. Each round times `--steps` steps of one, then of the other, alternating which goes
first; the figure is the median step time over all rounds. The ratio is this framework's tokens/s
over PyTorch's (1.0 = parity); MFU is each side's training FLOPs (the framework's model summary,
the same model for both) per second over the float32 matmul peak measured at start-up. The
framework runs `model.attention_impl=auto` (on a CPU the blocked attention of model/flash.py) and
its default `model.scan_unroll` (on a CPU the whole stack unrolled). Both use all the cores by
default (`--threads` sets PyTorch's intra-op threads; on a machine loaded by other processes its
OpenMP threads can collapse, so the load average is printed with the figures).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer import sharding
from transformer.config_loader import load_config
from transformer.train import preflight
from transformer.train.metrics import measure_cpu_matmul_peak
from transformer.train.trainer import Trainer, default_controls

try:
    import torch
    from torch import nn
    from torch.nn import functional as F
except ImportError:  # an optional benchmark dependency
    sys.exit("benchmarks/vs_pytorch.py needs PyTorch: pip install torch==2.13.0")

VOCAB = 320  # the byte tokenizer's 259, padded to a multiple of 64
# name: (layers, d_model, heads, seq_len, batch)
SHAPES = {
    "small": (4, 128, 4, 64, 12),
    "medium": (6, 384, 6, 256, 8),
    "t128": (4, 256, 4, 128, 32),  # the context sweep: 4,096 tokens a step
    "t512": (4, 256, 4, 512, 8),
    "t2048": (4, 256, 4, 2048, 2),
}
LR, BETAS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0


# --- PyTorch ---------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, D))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, seq_len: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class TorchRun:
    def __init__(self, shape: tuple[int, ...], rows: np.ndarray):
        layers, d, heads, T, _ = shape
        torch.manual_seed(0)
        self.model = GPT(layers, d, heads, T)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        self.inputs, self.targets = torch.from_numpy(rows[:, :-1]).long(), torch.from_numpy(rows[:, 1:]).long()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(self.inputs, self.targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        loss.item()  # wait for it, as the framework's step waits for its metrics


# --- this framework --------------------------------------------------------------------------------
class JaxRun:
    def __init__(self, shape: tuple[int, ...], rows: np.ndarray):
        layers, d, heads, T, B = shape
        overrides = [
            f"model.n_layers={layers}", f"model.d_model={d}", f"model.n_heads={heads}", f"model.n_kv_heads={heads}",
            "model.position=learned", "model.norm=layernorm", "model.norm_position=pre", "model.ffn=gelu",
            "model.use_bias=true", "model.tie_embeddings=true", "model.dtype=float32", f"data.seq_len={T}",
            f"train.batch_size={B}", "optim.name=adamw", f"optim.lr={LR}", f"optim.b1={BETAS[0]}",
            f"optim.b2={BETAS[1]}", f"optim.weight_decay={WEIGHT_DECAY}", f"optim.clip_norm={CLIP}",
            "optim.schedule=constant", "optim.warmup_steps=0", "model.attention_impl=auto",
        ]  # fmt: skip
        cfg = load_config(None, overrides).with_vocab(259)
        self.trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
        self.state = self.trainer.init(jax.random.key(0))
        self.batch = self.trainer.put_batch({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, B)

    def step(self) -> None:
        self.state, metrics = self.trainer.train_step(self.state, self.batch, default_controls())
        jax.block_until_ready(metrics)


def timed(run, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run.step()
        times.append(time.perf_counter() - start)
    return times


def compare(name: str, rounds: int, steps: int) -> tuple[float, float, float]:
    """(median step seconds of this framework, of PyTorch, the model's FLOPs per step) on one
    shape, interleaved."""
    shape = SHAPES[name]
    rows = np.random.default_rng(0).integers(0, 259, (shape[4], shape[3] + 1)).astype(np.int32)
    runs = {"jax": JaxRun(shape, rows), "torch": TorchRun(shape, rows)}
    for run in runs.values():  # compile / warm up
        timed(run, 2)
    times: dict[str, list[float]] = {"jax": [], "torch": []}
    for r in range(rounds):
        order = ["jax", "torch"] if r % 2 == 0 else ["torch", "jax"]
        for key in order:
            times[key] += timed(runs[key], steps)
    flops = preflight.work_per_step(runs["jax"].trainer.cfg)[1]
    return statistics.median(times["jax"]), statistics.median(times["torch"]), flops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="PyTorch's intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    peak = measure_cpu_matmul_peak()
    print(
        f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} ({args.threads} threads), "
        f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
        f"float32 matmul peak {peak / 1e9:.0f} GFLOP/s (measured, 512x512 in JAX)"
    )
    print(
        f"{'shape':<8} {'L/D/heads/T/B':<18} {'jax tok/s':>10} {'torch tok/s':>12} {'ratio':>6} {'jax MFU':>8} {'torch MFU':>10}"
    )
    for name in args.shapes:
        layers, d, heads, T, B = SHAPES[name]
        jax_s, torch_s, flops = compare(name, args.rounds, args.steps)
        tokens = B * T
        ratio = torch_s / jax_s if jax_s > 0 else math.nan
        print(
            f"{name:<8} {f'{layers}/{d}/{heads}/{T}/{B}':<18} {tokens / jax_s:>10,.0f} {tokens / torch_s:>12,.0f} "
            f"{ratio:>5.2f}x {flops / jax_s / peak:>8.1%} {flops / torch_s / peak:>10.1%}"
        )


if __name__ == "__main__":
    main()
