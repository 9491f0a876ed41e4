"""This framework's training step against the same model and optimiser in plain PyTorch, timed
interleaved, on the shapes of issue 17: both as a user gets it (`python train.py` with the model's
keys and every other key at its default) and as the bare jitted step.

    pip install torch==2.13.0      # an optional benchmark dependency (the `benchmark` extra), never a runtime one
    python benchmarks/vs_pytorch.py [--rounds 3] [--steps 5] [--shapes small medium t128 t512 t2048]
                                    [--train-steps 40] [--no-train-py]

The model is GPT-2 style: learned positions, pre-LayerNorm, GELU (tanh) MLP of 4D, biases, tied
embeddings, no dropout; AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1 on everything), gradient
norm clipped to 1.0; float32. The vocabulary is the byte tokenizer's padded to 320 (what this
framework computes; the padding rows are masked out of its softmax, not out of PyTorch's). Batches
are random tokens. Each round times `--steps` steps of one, then of the other, alternating which goes
first; the figure is the median step time over all rounds. The ratio is this framework's tokens/s
over PyTorch's (1.0 = parity); MFU is each side's training FLOPs (the framework's model summary,
the same model for both) per second over the float32 matmul peak measured at start-up. The bare
step runs the defaults of everything but the model's keys (`model.attention_impl: auto`, on a CPU
the blocked attention of model/flash.py; `model.scan_unroll: null`, on a CPU the whole stack
unrolled). Both use all the cores by default (`--threads` sets PyTorch's intra-op threads; on a
machine loaded by other processes its OpenMP threads can collapse, so the load average is printed
with the figures).

`train.py` runs once a round in its own process, on its built-in data (`builtin:stdlib`, the byte
tokenizer), for `--train-steps` steps with the default logging (every 10 steps), monitor, prefetch,
TensorBoard and checkpoint keys; its figure is the median of the `step_time` readings it logs to
metrics.jsonl, the first (which holds the compile) left out, over all rounds. So the two figures
can never drift apart: the bare step is what the inner loop costs, train.py what a user waits for.
Two process settings differ: train.py restarts itself with glibc's malloc in transparent huge pages
(`accelerator.malloc_tunables`) and has malloc keep a step's buffer between steps
(`accelerator.keep_step_buffers`: below 64 MiB in glibc's heap, above by the preloaded
keep_blocks.c); this process (the bare step and PyTorch) runs as it was started,
as a PyTorch user's would; `GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/vs_pytorch.py`
gives both sides the huge pages. The header line says which.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer import accelerator, sharding
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

ROOT = Path(__file__).resolve().parent.parent
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
def model_keys(shape: tuple[int, ...]) -> list[str]:
    """The overrides that make the default config the PyTorch model and optimiser; nothing else."""
    layers, d, heads, T, B = shape
    return [
        f"model.n_layers={layers}", f"model.d_model={d}", f"model.n_heads={heads}", f"model.n_kv_heads={heads}",
        "model.position=learned", "model.norm=layernorm", "model.norm_position=pre", "model.ffn=gelu",
        "model.use_bias=true", "model.tie_embeddings=true", "model.dtype=float32", f"data.seq_len={T}",
        f"train.batch_size={B}", "optim.name=adamw", f"optim.lr={LR}", f"optim.b1={BETAS[0]}",
        f"optim.b2={BETAS[1]}", f"optim.weight_decay={WEIGHT_DECAY}", f"optim.clip_norm={CLIP}",
        "optim.schedule=constant", "optim.warmup_steps=0",
    ]  # fmt: skip


class JaxRun:
    def __init__(self, shape: tuple[int, ...], rows: np.ndarray):
        cfg = load_config(None, model_keys(shape)).with_vocab(259)
        B = cfg.train.batch_size
        self.trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
        self.state = self.trainer.init(jax.random.key(0))
        self.batch = self.trainer.put_batch({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, B)

    def step(self) -> None:
        self.state, metrics = self.trainer.train_step(self.state, self.batch, default_controls())
        jax.block_until_ready(metrics)


class TrainPy:
    """`python train.py` on the shape, as a user runs it, once per `step` call in a fresh run directory."""

    def __init__(self, shape: tuple[int, ...], steps: int, scratch: Path):
        self.keys, self.steps, self.scratch, self.runs = model_keys(shape), steps, scratch, 0

    def step_times(self) -> list[float]:
        """The step_time readings of one whole run, the first (with the compile) left out."""
        self.runs += 1
        workdir = self.scratch / f"run{self.runs}"
        command = [
            sys.executable,
            str(ROOT / "train.py"),
            *self.keys,
            f"train.steps={self.steps}",
            "--workdir",
            str(workdir),
        ]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"train.py failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        return [r["step_time"] for r in rows if "step_time" in r][1:]


def timed(run, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run.step()
        times.append(time.perf_counter() - start)
    return times


def compare(name: str, rounds: int, steps: int, train_steps: int) -> tuple[dict[str, float], float]:
    """({side: median step seconds} for jax, torch and (train_steps > 0) train.py, the model's FLOPs
    per step) on one shape, interleaved round by round."""
    shape = SHAPES[name]
    rows = np.random.default_rng(0).integers(0, 259, (shape[4], shape[3] + 1)).astype(np.int32)
    runs = {"jax": JaxRun(shape, rows), "torch": TorchRun(shape, rows)}
    for run in runs.values():  # compile / warm up
        timed(run, 2)
    times: dict[str, list[float]] = {key: [] for key in runs}
    with tempfile.TemporaryDirectory(prefix="vs_pytorch_") as scratch:
        user = TrainPy(shape, train_steps, Path(scratch)) if train_steps else None
        for r in range(rounds):
            order = ["jax", "torch", "train.py"] if r % 2 == 0 else ["train.py", "torch", "jax"]
            for key in order:
                if key in runs:
                    times[key] += timed(runs[key], steps)
                elif user is not None:
                    times.setdefault(key, []).extend(user.step_times())
    flops = preflight.work_per_step(runs["jax"].trainer.cfg)[1]
    return {key: statistics.median(t) for key, t in times.items()}, flops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="PyTorch's intra-op threads")
    p.add_argument("--train-steps", type=int, default=40, help="steps of each train.py run (logged every 10)")
    p.add_argument("--no-train-py", dest="train_steps", action="store_const", const=0, help="the bare step only")
    args = p.parse_args()
    if args.train_steps and args.train_steps < 20:
        p.error(
            "--train-steps must be >= 20: train.py logs its step time every 10 steps and the first reading holds the compile"
        )
    torch.set_num_threads(args.threads)
    peak = measure_cpu_matmul_peak()
    print(
        f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} ({args.threads} threads), "
        f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
        f"float32 matmul peak {peak / 1e9:.0f} GFLOP/s (measured, 512x512 in JAX)"
    )
    here, theirs = os.environ.get("GLIBC_TUNABLES") or "unset", accelerator.malloc_environment()
    print(
        f"GLIBC_TUNABLES {here} in this process (jax, torch); train.py's runs {theirs.get('GLIBC_TUNABLES', here)}"
        + (", keep_blocks.c preloaded" if "LD_PRELOAD" in theirs else "")
    )
    sides = ["train.py", "jax", "torch"] if args.train_steps else ["jax", "torch"]
    print(f"{'shape':<8} {'L/D/heads/T/B':<16}" + "".join(f" {side + ' tok/s':>14} {'MFU':>6}" for side in sides) + "".join(
        f" {side + '/torch':>14}" for side in sides[:-1]
    ))  # fmt: skip
    for name in args.shapes:
        layers, d, heads, T, B = SHAPES[name]
        seconds, flops = compare(name, args.rounds, args.steps, args.train_steps)
        speeds = "".join(f" {B * T / seconds[s]:>14,.0f} {flops / seconds[s] / peak:>6.1%}" for s in sides)
        ratios = "".join(
            f" {seconds['torch'] / seconds[s] if seconds[s] > 0 else math.nan:>13.2f}x" for s in sides[:-1]
        )
        print(f"{name:<8} {f'{layers}/{d}/{heads}/{T}/{B}':<16}{speeds}{ratios}")


if __name__ == "__main__":
    main()
