"""Weighted max-min fair division of a step's capacity between tenants. Plain Python, exact integers.

The scheduler divides two things this way every step: the running slots (`max_num_seqs`) and the
token budget (`max_num_batched_tokens`). A tenant that wants less than its weighted share gets all
it wants; what it leaves over goes to the others in proportion to their weights; nobody is given
more than it asked for. So one tenant alone gets the whole machine, and a tenant that floods gets
the rest of it, never the part another tenant is entitled to.
"""
from __future__ import annotations

from collections.abc import Mapping


def fair_split(capacity: int, demands: Mapping[str, int], weights: Mapping[str, float]) -> dict[str, int]:
    """Each tenant's part of `capacity`, for `demands` (what each would use; zero or less asks for
    nothing) and `weights` (a tenant missing from it weighs 1). The parts add up to
    min(capacity, total demand). Fractions are given out by largest remainder, ties to the
    tenant that sorts first, so the answer depends on nothing but the arguments."""
    parts = {tenant: 0 for tenant in demands}
    wanting = {tenant: demand for tenant, demand in demands.items() if demand > 0}
    left = capacity
    while wanting and left > 0:
        total_weight = sum(weights.get(tenant, 1.0) for tenant in wanting)
        shares = {tenant: left * weights.get(tenant, 1.0) / total_weight for tenant in wanting}
        satisfied = [tenant for tenant, demand in wanting.items() if demand <= shares[tenant]]
        if not satisfied:  # everyone wants more than its share: split what is left and stop
            whole = {tenant: int(share) for tenant, share in shares.items()}
            spare = left - sum(whole.values())
            by_remainder = sorted(wanting, key=lambda tenant: (whole[tenant] - shares[tenant], tenant))
            for tenant in by_remainder[:spare]:
                whole[tenant] += 1
            for tenant, part in whole.items():
                parts[tenant] += part
            return parts
        for tenant in satisfied:
            demand = wanting.pop(tenant)
            parts[tenant] += demand
            left -= demand
    return parts
