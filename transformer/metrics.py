"""Run outputs: metrics.jsonl and events.jsonl, TensorBoard scalars, the progress bar, device peak FLOP/s."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets.
DEVICE_PEAKS = {
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
}


def measure_cpu_matmul_peak(n: int = 512, seconds: float = 1.0) -> float:
    """float32 FLOP/s of a square matmul on this CPU backend: the ceiling MFU is measured against."""
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            y = f(x)
        y.block_until_ready()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - start))
    return best


def device_peak_flops(device=None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from)."""
    device = device or jax.devices()[0]
    kind = device.device_kind.lower()
    for name, peak in DEVICE_PEAKS.items():
        if name in kind:
            return peak, f"{device.device_kind} data sheet (bf16 dense)"
    if device.platform == "cpu":
        # all CPU "devices" share the same cores: the measured peak is for the whole host
        return measure_cpu_matmul_peak() / max(1, jax.local_device_count()), "measured float32 matmul"
    return math.nan, f"unknown device {device.device_kind}"


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.generic, jax.Array)):
        value = np.asarray(value).item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than invalid
    return value


class RunWriter:
    """Writes one run's metrics and events. On processes other than 0 every call is a no-op."""

    def __init__(self, workdir: Path | None, enabled: bool, tensorboard: bool):
        self.enabled = enabled and workdir is not None
        self.tb = None
        if not self.enabled:
            return
        workdir.mkdir(parents=True, exist_ok=True)
        self.metrics = open(workdir / "metrics.jsonl", "a")
        self.events = open(workdir / "events.jsonl", "a")
        if tensorboard:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self.tb = EventFileWriter(str(workdir / "tb"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in values.items()}}
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            from tensorboard.compat.proto import event_pb2, summary_pb2

            tags = []
            for k, v in values.items():
                if isinstance(v, (list, tuple)):  # per-layer values: one tag per layer
                    tags += [(f"{k}/layer_{i}", x) for i, x in enumerate(v)]
                elif isinstance(v, (int, float, np.generic)):
                    tags.append((k, v))
            summary = summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(x)) for tag, x in tags]
            )
            self.tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def event(self, kind: str, step: int, **fields) -> None:
        if not self.enabled:
            return
        record = {"event": kind, "step": step, "time": time.time(), **{k: _jsonable(v) for k, v in fields.items()}}
        self.events.write(json.dumps(record) + "\n")
        self.events.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.metrics.close()
        self.events.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A one-line progress bar: step, loss, learning rate, tokens/s, ETA."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, leave=True)

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if self.bar is None:
            return
        self.bar.n = step
        self.bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} {tokens_per_s:,.0f} tok/s", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
