"""Sweeps: a config file with a `sweep:` block run as a set of member runs. Each module imports only
those above it in this list:

- `expansion.py`: the `sweep:` block (grid, zip, seeds, names, compare) expanded into validated
  `Member` configs, before anything runs;
- `ladder.py`: a `sweep.ladder` block (model sizes from parameter targets or shapes, token budgets
  from tokens per parameter or isoFLOP budgets, a learning-rate sub-grid per rung) expanded into
  one sweep axis (expansion.py uses it);
- `claims.py`: a member's claim (`DIR/<member>/.claim`, heartbeat, stale takeover) when several
  runners share a sweep directory;
- `runner.py`: the manifest and member configs written, and the members run as `train.py`
  processes (`SweepRunner`, `run_sweep`), dying with the sweep;
- `launch.py`: the `ray` and `slurm` launchers and their options.

A sweep's parent process runs no model: nothing here imports JAX (tests/test_structure.py).
"""

from transformer.sweep.expansion import LR_KEY, MANIFEST, Sweep, SweepError, default_compare, expand, load_sweep
from transformer.sweep.ladder import Ladder, ladder_lines
from transformer.sweep.launch import add_arguments, check_arguments, claimed, launch
from transformer.sweep.runner import member_config_path, prepare_sweep, print_commands, relative, run_sweep

__all__ = [
    "LR_KEY",
    "MANIFEST",
    "Ladder",
    "Sweep",
    "SweepError",
    "add_arguments",
    "check_arguments",
    "claimed",
    "default_compare",
    "expand",
    "ladder_lines",
    "launch",
    "load_sweep",
    "member_config_path",
    "prepare_sweep",
    "print_commands",
    "relative",
    "run_sweep",
]
