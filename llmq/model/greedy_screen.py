"""An int8 copy of a CPU model's LM head, which finds a greedy step's tokens from a fraction of its product.

A greedy step needs only each row's argmax of the LM head's logits (LlamaForCausalLM.greedy_tokens), and
the head is the largest matrix a small model multiplies in a decode step. Its int8 copy, multiplied by
int8 inputs (csrc/greedy_screen.h), gives every logit to within a bound worked out from the roundings of
both; only the columns that the bounds cannot rule out are multiplied again by the head itself, in the
same arithmetic as the whole product, so the tokens are the ones the whole product gives. The copy costs a
quarter of a float32 head's memory, or half of a bfloat16 one's, and the memory budget counts it (it is a
parameter of the head's module).

How much it saves depends on the model: the bound is relative to the spread of the logits, so a head
whose top logit stands clear of the rest (a trained model's, mostly) keeps a handful of candidates a row,
and inputs with a few very large values (which coarsen their int8 scale) keep more. The screen watches
its first rows and turns itself off where it does not pay (GreedyScreen.pays).

Where it runs: a CPU whose fused kernels have AVX512-VNNI (NativeKernels.screens_greedy_head), an LM head
whose greedy argmax the kernels take (in tiles, not on the matrix units, or in float32 panels), with no
bias. Off with EngineConfig(screen_greedy_head=False).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from llmq.model.cpu_kernels import is_paired, is_paneled, is_tiled, screened_argmax
from llmq.model.cpu_prepack import dense_weight
from llmq.model.huge_pages import huge_page_copy

log = logging.getLogger(__name__)

# Inputs a lane of the screen's product sums in one instruction, and the columns of a block (csrc/greedy_screen.h).
QUAD, BLOCK_COLUMNS = 4, 16
# The rows the screen is watched for before it is kept or turned off, and what it may cost at most to be
# kept, as shares of the rows and of the head's blocks: rows left to the whole product (each such call
# reads the whole head again), and blocks of 16 columns multiplied again a row (each read from memory on
# its own, for that row alone).
TRIAL_ROWS = 1024
MOST_WHOLE_ROWS_SHARE = 1 / 16
MOST_BLOCKS_SHARE = 1 / 32


class GreedyScreen(nn.Module):
    """The int8 copy of an LM head (`screen` [N/16, 16 K]) and its per-column terms (`terms` [3, N]), as
    screen_weight makes them, and what it has cost so far (`counts`: rows, blocks multiplied again, rows
    left to the whole product). A submodule of the head, so that its parameters count among the model's
    weights."""

    def __init__(self, screen: torch.Tensor, terms: torch.Tensor):
        super().__init__()
        self.screen = nn.Parameter(screen, requires_grad=False)
        self.terms = nn.Parameter(terms, requires_grad=False)
        self.counts = torch.zeros(3, dtype=torch.long)
        self._verdict: bool | None = None

    def argmax(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of x @ head.T (the first of equals), as the head's own greedy argmax gives it."""
        return screened_argmax(x, head, self.screen, self.terms, self.counts)

    @property
    def pays(self) -> bool:
        """Whether to go on screening: yes for the first TRIAL_ROWS rows, then only where they cost less
        than the shares above; decided once."""
        if self._verdict is None:
            rows, blocks, whole = self.counts.tolist()
            if rows < TRIAL_ROWS:
                return True
            self._verdict = (whole <= MOST_WHOLE_ROWS_SHARE * rows
                             and blocks <= MOST_BLOCKS_SHARE * rows * self.screen.shape[0])
            log.info("greedy screen %s after %d rows: %.1f blocks of %d multiplied again a row, %d rows left to "
                     "the whole product", "kept" if self._verdict else "turned off", rows, blocks / rows,
                     self.screen.shape[0], whole)
        return self._verdict


def screens(weight: torch.Tensor) -> bool:
    """Whether a dense weight [N, K] can have a screen: N whole blocks, K whole quads, every value finite."""
    return (weight.dim() == 2 and weight.shape[0] % BLOCK_COLUMNS == 0 and weight.shape[1] % QUAD == 0
            and bool(torch.isfinite(weight).all()))


def screen_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] -> (its int8 copy laid out for the screen [N/16, 16 K], terms [3, N] float32).
    Column j is scaled by its largest |w| / 127 (q = w / scale, rounded) and held as q + 128 in unsigned
    bytes (csrc/greedy_screen.h says why); the terms are that scale and the Euclidean norms of
    w - scale * q and of w, rounded up, so that the bounds built on them hold."""
    n, k = weight.shape
    exact = weight.double()
    largest = exact.abs().amax(dim=1)
    scale = torch.where(largest > 0, largest / 127, torch.ones_like(largest)).float()
    q = torch.round(exact / scale.double()[:, None]).clamp(-127, 127)
    residual = (exact - q * scale.double()[:, None]).norm(dim=1)
    terms = torch.stack([scale, _rounded_up(residual), _rounded_up(exact.norm(dim=1))])
    # Block b, input quad t, column c of the block: column 16 b + c's inputs 4 t .. 4 t + 3.
    layout = (q + 128).to(torch.uint8).view(n // BLOCK_COLUMNS, BLOCK_COLUMNS, k // QUAD, QUAD).permute(0, 2, 1, 3)
    return layout.contiguous().view(n // BLOCK_COLUMNS, k * BLOCK_COLUMNS), terms.contiguous()


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> the float32 values at or above them."""
    single = values.float()
    return torch.where(single.double() < values, torch.nextafter(single, torch.tensor(float("inf"))), single)


def add_greedy_screen(model: nn.Module, kernels) -> bool:
    """Give the model's LM head its screen where it can use one here (see the module's docstring);
    returns whether it did."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if (weight is None or not getattr(kernels, "screens_greedy_head", False) or getattr(head, "bias", None) is not None
            or not model.has_greedy_head):
        return False
    if is_tiled(weight) and not is_paired(weight):
        if kernels.tiled_products == "amx":  # the matrix units' product: as fast without
            return False
    elif not (is_paneled(weight) and weight.dtype == torch.float32):
        return False
    dense = dense_weight(weight)
    if not screens(dense):
        return False
    screen, terms = screen_weight(dense)
    head.greedy_screen = GreedyScreen(huge_page_copy(screen), terms)  # streamed whole by every greedy step
    return True
