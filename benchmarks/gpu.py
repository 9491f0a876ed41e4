"""One cell of the GPU table: training throughput, MFU and peak memory of one model with one
attention implementation; `--table` turns the cells `benchmarks/gpu.sh` collected into Markdown.

    python benchmarks/gpu.py --model gpt2-124m --attention cudnn [--steps 10] [--tiny] [key=value ...]   # one JSON line
    python benchmarks/gpu.py --table results.jsonl                                         # the table

Models at T=2048, bf16 compute with float32 parameters and AdamW state, random tokens (this measures
the step, not the data pipeline). The step is planned first (`transformer/train/preflight.py`): a model
whose step does not fit is rerun with `model.remat=full` in a fresh process (the allocator's peak
is per process, and compiling the program that did not fit raises it: llama-1b with XLA's attention
peaked at 103 GB after that compile, at its plan's 27.6 GB in a process of its own), and the table
names the override. MFU is
against the device's datasheet bf16 dense peak (`transformer/train/metrics.py`), with the model summary's
FLOPs per token. Peak memory is the device allocator's high-water mark (`memory_stats`), which is why
each cell runs in its own process. `--tiny` shrinks every model to a few thousand parameters so that
the script itself can be checked on a CPU; its figures mean nothing. Overrides after the flags
(`model.remat=full`, `model.scan_unroll=12`, ...) change one cell, which then runs as given (no
retry with remat) and the table names them beside the model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput import Stepper

from transformer import accelerator, limits
from transformer.config import ConfigError
from transformer.config_loader import load_config
from transformer.model.summary import count_params, flops_per_token
from transformer.train import preflight
from transformer.train.metrics import device_peak_flops

COMMON = ["model.dtype=bfloat16", "model.param_dtype=float32", "data.seq_len=2048", "optim.name=adamw"]
MODELS = {  # GPT-2 small / medium (learned positions, LayerNorm, GELU, tied) and a Llama-3.2-1B shape
    "gpt2-124m": [
        "model.d_model=768", "model.n_layers=12", "model.n_heads=12", "model.n_kv_heads=12",
        "model.position=learned", "model.norm=layernorm", "model.ffn=gelu", "model.use_bias=true",
        "model.tie_embeddings=true", "data.tokenizer=bpe", "data.vocab_size=50257", "train.batch_size=16",
    ],
    "gpt2-350m": [
        "model.d_model=1024", "model.n_layers=24", "model.n_heads=16", "model.n_kv_heads=16",
        "model.position=learned", "model.norm=layernorm", "model.ffn=gelu", "model.use_bias=true",
        "model.tie_embeddings=true", "data.tokenizer=bpe", "data.vocab_size=50257", "train.batch_size=8",
    ],
    "llama-1b": [
        "model.d_model=2048", "model.n_layers=16", "model.n_heads=32", "model.n_kv_heads=8",
        "model.d_ff=8192", "model.position=rope", "model.rope_theta=500000", "model.norm=rmsnorm",
        "model.ffn=swiglu", "model.tie_embeddings=true", "data.tokenizer=bpe", "data.vocab_size=128256",
        "train.batch_size=4",
    ],
}  # fmt: skip
TINY = [  # the same code paths, small enough for a CPU
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4", "model.d_ff=null",
    "data.seq_len=64", "data.vocab_size=512", "train.batch_size=2",
]  # fmt: skip


def config(model: str, attention: str, tiny: bool, extra: list[str]):
    overrides = [*COMMON, *MODELS[model], f"model.attention_impl={attention}", *(TINY if tiny else []), *extra]
    cfg = load_config(None, overrides)
    return cfg.with_vocab(preflight.vocab_size(cfg))


def time_steps(cfg, steps: int) -> list[float]:
    stepper = Stepper(cfg)
    stepper.steps(1)  # one more warm step after the compile
    return stepper.steps(steps)


def measure(model: str, attention: str, steps: int, tiny: bool, extra: list[str]) -> dict:
    device = jax.devices()[0]
    row: dict = {"model": model, "attention": attention, "device": device.device_kind, "jax": jax.__version__}
    row |= {"overrides": extra} if extra else {}
    try:
        cfg = config(model, attention, tiny, extra)
        plan = preflight.plan(cfg, preflight.local_target())
        limits.check_attention_support(cfg.model)
    except (ConfigError, preflight.OutOfMemory) as e:
        return {**row, "error": str(e)}
    if not plan.fits and not extra:  # once more, with full rematerialisation, in a process of its own
        sys.stdout.flush()
        argv = [sys.executable, __file__, "--model", model, "--attention", attention, "--steps", str(steps)]
        os.execv(sys.executable, [*argv, *(["--tiny"] if tiny else []), "model.remat=full"])
    times = time_steps(cfg, steps)
    step = statistics.median(times)
    tokens = cfg.train.batch_size * cfg.data.seq_len
    peak, source = device_peak_flops(device)
    flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens / step
    stats = device.memory_stats() or {}
    return {
        **row,
        "params": count_params(cfg.model),
        "batch": f"{cfg.train.batch_size}x{cfg.data.seq_len}",
        "remat": cfg.model.remat,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "mfu": flops / (peak * jax.device_count()),
        "peak_source": source,
        "peak_memory": stats.get("peak_bytes_in_use"),
        "planned_memory": plan.total,
        "compile_s": plan.compile_s,
        "tiny": tiny,
    }


def table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = [
        "| model | attention | params | batch | remat | tokens/s | MFU | peak memory | planned | device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['model']} | {r['attention']} | | | | not run: {r['error']} | | | | {r.get('device', '')} |"
            )
            continue
        peak = limits.human_bytes(r["peak_memory"]) if r.get("peak_memory") else "n/a"
        out.append(
            f"| {r['model']}{' (tiny)' if r.get('tiny') else ''}{''.join(' ' + o for o in r.get('overrides', []))} | {r['attention']} | {r['params'] / 1e6:.1f}M | "
            f"{r['batch']} | {r['remat']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {peak} | "
            f"{limits.human_bytes(r['planned_memory'])} | {r['device']} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS))
    p.add_argument("--attention", choices=["xla", "cudnn"], default="xla")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny models, to check the script on a CPU")
    p.add_argument("--table", type=Path, default=None, help="print the Markdown table of a results.jsonl")
    p.add_argument("overrides", nargs="*", help="key=value overrides of this cell")
    args = p.parse_args()
    accelerator.apply_xla_gpu_flags()  # as train.py does, before JAX starts its backend
    if args.table is not None:
        print(table(args.table))
        return
    if args.model is None:
        p.error("give --model (or --table)")
    print(json.dumps(measure(args.model, args.attention, args.steps, args.tiny, args.overrides)))


if __name__ == "__main__":
    main()
