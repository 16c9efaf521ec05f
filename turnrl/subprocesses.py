"""What child processes of turnrl's share: a child that does not outlive its parent."""

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A `preexec_fn`: runs in the child before exec and has the kernel send it SIGTERM when its
    parent dies, so that a killed launcher or rollout service leaves no service or inference
    server behind (holding ports or GPUs)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
