"""A small dense LP front end to HiGHS, for the fitting code (L1 and minimax fits).

    minimize c @ x   subject to   A_eq x = b_eq,   A_ub x <= b_ub,   lo <= x <= hi
"""

from __future__ import annotations

import contextlib
import os
import sys

import highspy
import numpy as np


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a banner on the C-level stdout at its first construction; keep it out of
    machine-readable output (``--json``)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no real fd 1 (e.g. under a test runner's capture)
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_lp(
    c: np.ndarray,
    *,
    a_eq: np.ndarray | None = None,
    b_eq: np.ndarray | None = None,
    a_ub: np.ndarray | None = None,
    b_ub: np.ndarray | None = None,
    lower: np.ndarray | None = None,
    upper: np.ndarray | None = None,
) -> np.ndarray:
    """Optimal ``x`` of the LP; raises RuntimeError when HiGHS finds no optimum."""
    n = len(c)
    rows = []
    row_lo: list[float] = []
    row_hi: list[float] = []
    if a_eq is not None and b_eq is not None:
        rows.append(np.asarray(a_eq, dtype=float))
        row_lo += list(map(float, b_eq))
        row_hi += list(map(float, b_eq))
    if a_ub is not None and b_ub is not None:
        rows.append(np.asarray(a_ub, dtype=float))
        row_lo += [-highspy.kHighsInf] * len(b_ub)
        row_hi += list(map(float, b_ub))
    matrix = np.vstack(rows) if rows else np.zeros((0, n))
    lo = np.zeros(n) if lower is None else np.asarray(lower, dtype=float)
    hi = np.full(n, highspy.kHighsInf) if upper is None else np.asarray(upper, dtype=float)

    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = matrix.shape[0]
    lp.col_cost_ = np.asarray(c, dtype=float)
    lp.col_lower_ = lo
    lp.col_upper_ = hi
    lp.row_lower_ = np.asarray(row_lo, dtype=float)
    lp.row_upper_ = np.asarray(row_hi, dtype=float)
    # column-wise sparse storage
    starts = [0]
    index: list[int] = []
    value: list[float] = []
    for j in range(n):
        nz = np.nonzero(matrix[:, j])[0]
        index.extend(int(i) for i in nz)
        value.extend(float(v) for v in matrix[nz, j])
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(value, dtype=float)

    with _quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"LP not solved: {h.modelStatusToString(h.getModelStatus())}")
    return np.asarray(h.getSolution().col_value, dtype=float)
