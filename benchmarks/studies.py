"""How long a sweep's members took, from the events each run journals: the time from its `start`
event to its `end` (or `stopped`) event, and the wall time of the whole sweep, from the first
start to the last end. Process start-up and data loading before `start` (a few seconds per member)
are not in the member times but are in the sweep's wall time.

    python benchmarks/studies.py runs/norm_placement [runs/attention ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from transformer import rundir


def member_times(directory: Path) -> dict[str, tuple[float, float, float]]:
    """{member: (start time, end time, seconds)} for the members that finished or were stopped."""
    out = {}
    for workdir in sorted(p.parent for p in directory.glob(f"*/{rundir.EVENTS}")):
        records = rundir.read_events(workdir)
        starts = [r["time"] for r in records if r["event"] == "start"]
        ends = [r["time"] for r in records if r["event"] in ("end", "stopped")]
        if starts and ends:
            out[workdir.name] = (starts[0], ends[-1], ends[-1] - starts[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    for directory in parser.parse_args().sweeps:
        times = member_times(directory)
        if not times:
            print(f"{directory}: no finished members")
            continue
        seconds = np.array([t for _, _, t in times.values()])
        wall = max(e for _, e, _ in times.values()) - min(s for s, _, _ in times.values())
        slowest = max(times, key=lambda k: times[k][2])
        print(
            f"{directory}: {len(times)} members; per member median {np.median(seconds):.0f} s, "
            f"max {seconds.max():.0f} s ({slowest}); sweep wall {wall / 60:.1f} min"
        )


if __name__ == "__main__":
    main()
