"""Exit codes of the command-line tools, and the one-line form of an exception.

User mistakes end with EXIT_USAGE and one line on stderr; failures of a run that cannot go on with
EXIT_FAILED; a run stopped by a signal after checkpointing with EXIT_PREEMPTED (run it again).
"""

from __future__ import annotations

import re

EXIT_FAILED = 1  # the run could not go on: no usable checkpoint, a failed save, the monitor gave up
EXIT_USAGE = 2  # a user mistake: config, arguments, data, an unsafe change on resume
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGINT after writing a checkpoint (EX_TEMPFAIL: run it again)


# tensorstore appends the whole JSON spec of each store it failed on (2,000 characters on one line)
_TENSORSTORE_SPEC = re.compile(r" ?\[tensorstore_spec(?:\[\d+\])?='(?:[^'\\]|\\.)*'\]")


def first_line(e: BaseException, with_type: bool = False) -> str:
    """The first line of an exception's message (its type's name if it has none), for one-line
    errors that wrap a library's multi-line ones; `with_type` puts the type's name in front."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    line = _TENSORSTORE_SPEC.sub("", lines[0])
    return f"{type(e).__name__}: {line}" if with_type else line
