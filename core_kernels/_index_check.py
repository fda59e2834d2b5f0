"""Opt-in validation of index data (framework-free): one check per op.

The kernels read block tables, start offsets, cumulative lengths, sparse
layouts and slot ids from device memory and trust them: a bad entry gives
garbage, a hang or an illegal memory access, and checking it needs the values
on the host (a device sync). So the check is opt-in (docs/index_validation.md):

- the switch: the environment variable ``TANDEM_VALIDATE_INDICES`` (``1``,
  ``true``, ``yes``, ``on``: on) and, per call, the keyword-only argument
  ``validate_indices`` of every op that takes index data (True / False; None
  follows the environment). :func:`requested` resolves them, for both adapters.
- the adapters copy every index array of the call to the host at once (one
  sync) and call the op's ``check_<op>(host, **static)`` below before planning
  and launching. ``host`` maps argument names to numpy arrays (integer dtype);
  ``static`` carries the shapes and options the check needs. A check raises
  ValueError naming the argument ("b_loc: ...") or returns None.
- a check returns without a word when the arrays' shapes or dtypes do not fit
  each other: those are the planner's errors, raised right after (the adapters
  pass int32 / int64 arrays only, each in its own dtype).

Adding an op (the hook): write ``check_<op>(host, **static)`` in the op's
folder (``core_kernels/<op>/checks.py``; this module holds only the switch and
the helpers every check shares), give the public function of each adapter a keyword-only
``validate_indices=None`` and call, before planning::

    if index_validation(validate_indices, *index_arrays):
        check_indices(check_<op>, dict(name=array, ...), **static)

where ``index_validation`` and ``check_indices`` come from
``adapters.<torch|jax>._index_validation``; the host copy, the switch and the
torch.compile / CUDA graph / jax.jit rules are theirs. An op without index
data has no check and no argument.
"""
from __future__ import annotations

import os

import numpy as np

ENV_VAR = "TANDEM_VALIDATE_INDICES"
_OFF = ("", "0", "false", "no", "off")
_ENV_KEY = os.environ.encodekey(ENV_VAR) if hasattr(os.environ, "encodekey") else ENV_VAR


def _env_on() -> bool:
    """TANDEM_VALIDATE_INDICES, read at each call (so a change of os.environ
    applies at once). NOTE: os.environ.get costs 1.4 us per call on the 2-core
    CI machine (key encoding and the mapping protocol), the raw dict lookup
    below 0.06 us, with the decode step's whole host time ~7 us on the H200
    machine; the mapping is the fallback where os.environ is not CPython's."""
    env = os.environ
    data = getattr(env, "_data", None)
    raw = env.get(ENV_VAR) if data is None else data.get(_ENV_KEY)
    if raw is None:
        return False
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    return raw.strip().lower() not in _OFF


def requested(flag=None) -> bool:
    """Whether a call validates its index data: ``flag`` (the op's
    ``validate_indices``) when it is True or False, else the environment
    variable TANDEM_VALIDATE_INDICES (read at each call; unset, "", "0",
    "false", "no", "off": off)."""
    if flag is None:
        return _env_on()
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"validate_indices: expected True, False or None (follow {ENV_VAR}), "
                        f"got {flag!r}")
    return bool(flag)


def first_index(mask) -> int:
    return int(np.flatnonzero(mask)[0])


def as_int64(x) -> np.ndarray:
    return np.asarray(x).astype(np.int64, copy=False)


def check_cumulative(name: str, cu: np.ndarray, *, start: int | None, end: int | None,
                      limit: int, what: str) -> np.ndarray:
    """Offsets ``cu`` [B + 1]: non-decreasing, cu[0] == start (>= 0 when None),
    cu[-1] == end (<= limit when None); returns the lengths [B]."""
    if start is not None and cu[0] != start:
        raise ValueError(f"{name}: {name}[0] = {int(cu[0])}, expected {start} ({what})")
    if cu[0] < 0:
        raise ValueError(f"{name}: {name}[0] = {int(cu[0])} is negative")
    lens = np.diff(cu)
    if (lens < 0).any():
        i = first_index(lens < 0)
        raise ValueError(f"{name}: must be non-decreasing, got {name}[{i}] = {int(cu[i])} then "
                         f"{name}[{i + 1}] = {int(cu[i + 1])}")
    if end is not None and cu[-1] != end:
        raise ValueError(f"{name}: {name}[-1] = {int(cu[-1])}, expected {end} ({what})")
    if cu[-1] > limit:
        raise ValueError(f"{name}: {name}[-1] = {int(cu[-1])} exceeds the token count ({what})")
    return lens
