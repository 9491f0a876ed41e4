"""What a run measures about itself: device peak FLOP/s, its throughput and MFU, and the progress bar."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

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


class Throughput:
    """Training speed over the steps since the last reading: seconds per step, tokens/s, TFLOP/s
    per device and MFU (model FLOPs utilisation: achieved over `peak` FLOP/s, per device).

    Only training counts: `restart` the clock after evaluating or saving, and after a rollback.
    One reading over few steps can be far off (on a CPU a step may run inside its dispatch, so the
    time lands on the reading before), hence also the whole run's figures: `overall`."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, devices: int, peak: float, step: int = 0):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.devices, self.peak = devices, peak
        self.tokens_per_s = self.mfu = 0.0  # the latest reading
        self.steps, self.seconds = 0, 0.0  # every reading's, summed
        self.restart(step)

    def overall(self) -> tuple[float, float]:
        """(tokens/s, MFU) over all the training time read so far."""
        if not self.seconds:
            return 0.0, 0.0
        per_s = self.steps / self.seconds
        return self.tokens_per_step * per_s, self.flops_per_step * per_s / self.devices / self.peak

    def restart(self, step: int) -> None:
        """Count from now, at `step`."""
        self.last_time, self.last_step = time.perf_counter(), step

    def measure(self, step: int) -> dict[str, float]:
        """The speed since the last reading or restart, as metrics (none if no step was done since),
        and restart the clock at `step`."""
        now = time.perf_counter()
        values = {}
        if step > self.last_step:
            self.steps, self.seconds = self.steps + step - self.last_step, self.seconds + now - self.last_time
            seconds = (now - self.last_time) / (step - self.last_step)
            self.tokens_per_s = self.tokens_per_step / seconds
            flops = self.flops_per_step / seconds / self.devices  # FLOP/s of one device
            self.mfu = flops / self.peak
            values = dict(
                step_time=seconds, tokens_per_s=self.tokens_per_s, tflops_per_device=flops / 1e12, mfu=self.mfu
            )
        self.last_time, self.last_step = now, step
        return values


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
