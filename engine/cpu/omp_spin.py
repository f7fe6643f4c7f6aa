"""OpenMP's idle spinning, bounded for a server that shares its cores.

torch's OpenMP runtime (GNU libgomp) lets a thread that waits at a barrier, or for the next
parallel region, spin about 300,000 times before it sleeps. On cores of its own that is the
fastest wait. Where other processes want the same cores, a spinning thread burns the time slice
its partner needs to reach the barrier, and a region that takes microseconds can take a
scheduler tick or more: a 16-token request that takes half a second on two busy cores then
takes 4 to 24 seconds now and then, and the start-up's measurements stretch from under a
second to 20 (docs/performance.md#busy-cores has the runs).

:func:`bound_spinning` sets ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` (a few microseconds of
spinning, then a futex wait) unless the user set it or ``OMP_WAIT_POLICY``. libgomp reads it
once, when it loads: the call has effect only before torch is imported (``kvserve``'s entry
point calls it first)."""

from __future__ import annotations

import sys

from engine import envs

SPIN_COUNT = 3000  # spins before a waiting OpenMP thread sleeps (libgomp's default: 300000)
VARIABLE = envs.GOMP_SPINCOUNT


def bound_spinning() -> str | None:
    """Set :data:`VARIABLE` for this process to :data:`SPIN_COUNT` where neither it nor
    ``OMP_WAIT_POLICY`` is set and torch is not yet imported; returns the value set, None
    when it left the environment as it was."""
    if (envs.get(VARIABLE) is not None or envs.get(envs.OMP_WAIT_POLICY) is not None
            or "torch" in sys.modules):
        return None
    envs.set_default(VARIABLE, str(SPIN_COUNT))
    return envs.get(VARIABLE)


def describe() -> str:
    """How waiting OpenMP threads behave in this process, for the start-up log."""
    spins, policy = envs.get(VARIABLE), envs.get(envs.OMP_WAIT_POLICY)
    if spins is not None:
        return f"OpenMP threads spin {spins} times, then sleep ({VARIABLE})"
    if policy is not None:
        return f"OpenMP wait policy {policy} (OMP_WAIT_POLICY)"
    return "OpenMP threads spin libgomp's default 300000 times, then sleep"
