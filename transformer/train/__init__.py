"""Training: what one step computes and the loop, job and checks around it. Each module imports only
those above it in this list (or none of them):

- `loss.py`: the objective, float32 cross-entropy and z-loss, plain or chunked over positions;
- `muon.py`: Muon's step for the hidden matrices (momentum, Newton-Schulz orthogonalisation of
  each layer's, expert's and fused projection's matrix, the shape scale);
- `soap.py`: SOAP's step for the hidden matrices (Adam in the eigenbases of each matrix's Shampoo
  factors, refreshed by power iteration and QR);
- `schedule_free.py`: schedule-free AdamW's averaging, with the average as the parameters and
  the gradients taken at the interpolation (`gradient_point`);
- `optim.py`: the optax chain (schedule, optimiser, weight-decay mask, clipping; Muon's and SOAP's
  two groups);
- `trainer.py`: the train state and the jitted init, train, eval and stats steps (`Trainer`);
- `validation.py`: validation on the host, each source's windows through the eval step;
- `preflight.py`: the train step compiled ahead of time (local devices or a TPU topology), its
  memory per device and FLOPs;
- `coordcheck.py`: `--coord-check`, the model trained a few steps at a series of widths (or
  depths) and the RMS of its activations against size (µP's check, under the standard
  parametrization beside it; depth scaling's, without it beside it; a sweep's distinct models each
  once);
- `gradprofile.py`: `--grad-profile`, each layer's gradient norm per parameter after one backward
  pass at initialisation (Xiong et al.'s measurement; report/gradients.py compares a sweep's);
- `monitor.py`: spike and divergence detection, the recovery state replayed from events, faults;
- `metrics.py`, `feed.py`, `signals.py`, `profile.py`, `wandb_sink.py`: the throughput/MFU meter
  and progress bar, batches made ahead on a thread, SIGTERM/SIGINT as a request to stop, the
  profiler window, W&B as a second home for the scalars;
- `loop.py`: the host loop (`TrainLoop`): steps, metrics one step late, validation, checkpoints,
  rollback, preemption;
- `job.py`: what `train.py` runs (`run`): resume policy, config checks, start-up lines.

The face resolves its names lazily (`transformer/lazy.py`): the sweep's parent process reads
`signals` through it and must not import JAX.
"""

from typing import TYPE_CHECKING

from transformer.lazy import exports

if TYPE_CHECKING:  # the names as mypy sees them; at run time __getattr__ imports each on first use
    from transformer.train.coordcheck import (  # noqa: F401
        COORD_STEPS,
        COORD_WIDTHS,
        distinct_models,
        run_coord_check,
        write_coord_check,
    )
    from transformer.train.gradprofile import GradProfile, grad_profile, write_profile  # noqa: F401
    from transformer.train.job import run  # noqa: F401
    from transformer.train.monitor import MonitorStop  # noqa: F401
    from transformer.train.preflight import OutOfMemory, run_preflight, work_per_step  # noqa: F401
    from transformer.train.signals import PARENT_PID_ENV, Preempted  # noqa: F401
    from transformer.train.trainer import Trainer  # noqa: F401
    from transformer.train.validation import validation_metrics  # noqa: F401
    from transformer.train.wandb_sink import check_credentials  # noqa: F401

__all__, __getattr__ = exports(
    __name__,
    {
        "coordcheck": ("COORD_STEPS", "COORD_WIDTHS", "distinct_models", "run_coord_check", "write_coord_check"),
        "gradprofile": ("GradProfile", "grad_profile", "write_profile"),
        "job": ("run",),
        "monitor": ("MonitorStop",),
        "preflight": ("OutOfMemory", "run_preflight", "work_per_step"),
        "signals": ("PARENT_PID_ENV", "Preempted"),
        "trainer": ("Trainer",),
        "validation": ("validation_metrics",),
        "wandb_sink": ("check_credentials",),
    },
)
