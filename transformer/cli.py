"""Command-line front ends. `train.py` and `eval.py` only call into here.

User mistakes (bad config, bad arguments) end with exit code 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import sys

from transformer.config import ConfigError, load_config

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + error
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def train_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="train.py", description="Train a decoder-only Transformer from a YAML config.")
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, values parsed as YAML")
    p.add_argument("--workdir", default=None, help="run directory (resumed if it holds checkpoints)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and model summary, then exit")
    return p


def train_main(argv: list[str] | None = None) -> int:
    args = train_parser().parse_intermixed_args(argv)
    # A first positional with '=' is an override, not a file: `train.py model.window=64` works too.
    if args.config is not None and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        _fail("train.py", f"config: {e}")
    if args.dry_run:
        from transformer.model.summary import summary_text

        print(cfg.to_yaml().rstrip())
        print()
        print(summary_text(cfg.model, cfg.data.seq_len))
        return 0
    _fail("train.py", "the training loop is not built yet; use --dry-run to check a config")
    return EXIT_USAGE
