"""How a worker whose model is FSDP2-sharded over gloo ends: without finalizing Python.

FSDP2's own collectives (the all-gathers of forward, the reduce-scatters of backward)
hand gloo short-lived CPU tensors. Gloo's worker thread drops its reference to such a
tensor a moment after the collective is marked done, and when that reference is the
last one the worker thread frees the Python object, which needs the GIL. If its turn
comes while the interpreter is finalizing, Python ends that non-Python thread with
pthread_exit, the unwinding meets a noexcept C++ frame and the rank aborts ("terminate
called without an active exception", exit -6) after a good run: about one run in five on
a loaded 2-core machine. gradientmail's own collectives hold their tensors until gloo let
go (gradientmail.integration.ranks); FSDP2's are not ours to hold. On GPUs (NCCL) this
does not arise. A worker that has written its results therefore leaves with os._exit.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave() -> NoReturn:
    """Flush stdout and stderr and exit 0 without finalizing the interpreter."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
