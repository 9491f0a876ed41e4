"""python train.py [CONFIG.yaml] [key.path=value ...] [--workdir DIR] [--dry-run]"""

import os
import signal
import sys

from transformer.errors import EXIT_PREEMPTED


def _preempted_early(signum, frame):
    """A SIGTERM before training installs its own handler (imports, data, compile): nothing was
    trained yet, so the run is preempted (75: a scheduler requeues it), not killed (143). It exits at
    once, as a SIGKILL would (which every write of a run survives): an exception raised here could
    land in a callback that swallows it, and the run would go on."""
    print(
        "train.py: stopped by SIGTERM outside training (nothing unsaved is lost); run the same command",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_PREEMPTED)


signal.signal(signal.SIGTERM, _preempted_early)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one held across the restart below: now

from transformer.accelerator import restart_with_malloc_tunables  # noqa: E402  (the standard library's only)

if __name__ == "__main__":
    # before JAX and the CLI's imports (~0.1 s, paid twice otherwise): glibc reads its tunables once
    restart_with_malloc_tunables(hold=(signal.SIGTERM,))
    from transformer.cli import train_main  # after the handler: its imports take a while

    sys.exit(train_main())
