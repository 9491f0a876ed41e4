"""Data pipeline speed: tokenisation throughput and the cost of producing one global batch.

    python benchmarks/data.py [--tokenizers byte bpe] [--repeats 3] [key.path=value ...]

Tokenisation runs into a fresh temporary cache each repeat (the median is reported, MB of UTF-8
text per second over both splits); then the time to start over a complete cache, and the median time
to materialise one global batch of the default config, next to the default training step's time
(from benchmarks/throughput.py), alone and as a mixture of three sources (the standard library and
two of its packages as .jsonl sources, weights 0.5 / 0.3 / 0.2; --no-mixture leaves it out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer import data as datalib
from transformer.config_loader import load_config
from transformer.data import splits as data_splits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizers", nargs="+", default=["byte", "bpe"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-mixture", action="store_true", help="skip the three-source mixture's batch time")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    base = load_config(None, args.overrides)
    for tok in args.tokenizers:
        rates, starts = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache:
                cfg = load_config(None, [*args.overrides, f"data.tokenizer={tok}", f"data.cache_dir={cache}"])
                data_splits._load_splits.cache_clear()
                data_splits.load_splits(cfg.data)  # reading the files is not tokenising: keep it out
                start = time.perf_counter()
                d = datalib.prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
                seconds = time.perf_counter() - start
                meta = json.loads((d.cache_path / "meta.json").read_text())
                mb = (meta["train"]["bytes"] + meta["val"]["bytes"]) / 1e6
                rates.append(mb / seconds)
                data_splits._load_splits.cache_clear()
                start = time.perf_counter()
                datalib.prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
                starts.append(time.perf_counter() - start)
        extra = f" (vocab {cfg.data.vocab_size}, training the BPE included)" if tok == "bpe" else ""
        print(
            f"{tok:>5}: tokenise {mb:.1f} MB at {statistics.median(rates):.2f} MB/s{extra}; "
            f"start over a complete cache {statistics.median(starts):.2f} s"
        )
    print(f"one global batch ({base.train.batch_size} x {base.data.seq_len}): {batch_time(base.data, base)}")
    if not args.no_mixture:
        with tempfile.TemporaryDirectory() as root:
            # its own cache: the .jsonl sources are new files each time
            cfg = load_config(None, [*args.overrides, mixture_override(Path(root)), f"data.cache_dir={root}/cache"])
            print(f"one global batch of a 3-source mixture: {batch_time(cfg.data, cfg)}")


def mixture_override(root: Path) -> str:
    """data.mixture of the standard library (weight 0.5) and two of its packages written as .jsonl
    sources (files: reads .txt/.jsonl/.parquet/.csv, not .py): email (0.3) and asyncio (0.2)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    entries = ["{source: 'builtin:stdlib', weight: 0.5, name: stdlib}"]
    for package, weight in (("email", 0.3), ("asyncio", 0.2)):
        rows = [
            json.dumps({"text": f.read_text("utf-8", errors="replace")}) for f in sorted((lib / package).rglob("*.py"))
        ]
        (root / f"{package}.jsonl").write_text("\n".join(rows) + "\n")
        entries.append(f"{{source: 'files:{root / package}.jsonl', weight: {weight}, name: {package}}}")
    return f"data.mixture=[{', '.join(entries)}]"


def batch_time(data_cfg, cfg, steps: int = 200) -> str:
    """The median time of `Data.train_batch` over `steps` steps (its data prepared first)."""
    d = datalib.prepare(data_cfg, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        d.train_batch(step)
        times.append(time.perf_counter() - start)
    return f"median {1e3 * statistics.median(times):.2f} ms over {steps} steps"


if __name__ == "__main__":
    main()
