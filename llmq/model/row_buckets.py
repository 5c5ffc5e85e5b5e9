"""The row counts a CPU step's matrix products are padded to.

oneDNN builds a kernel (a "primitive") for every new shape of a product with a prepacked weight
(llmq/model/cpu_prepack.py), and building one takes longer than running it: with the number of rows
free to take any value, every new batch size or prompt chunk paid that again. Padding a step's rows up
to one of a few counts bounds the kernels to build, once each; the padding rows cost arithmetic, which
at decode sizes is nearly free (the product is bound by reading the weight).
"""
from __future__ import annotations

FINE_STEP, FINE_LIMIT, COARSE_STEP = 8, 256, 64


def padded_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of 8 up to 256 rows (at most 7 rows of padding), else to a
    multiple of 64 (under a quarter of the rows)."""
    if rows <= 0:
        return rows
    step = FINE_STEP if rows <= FINE_LIMIT else COARSE_STEP
    return -(-rows // step) * step


def buckets_up_to(rows: int) -> list[int]:
    """Every count `padded_rows` gives for 1..rows, ascending."""
    return sorted({padded_rows(n) for n in range(1, rows + 1)})
