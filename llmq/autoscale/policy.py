"""The autoscaling policy: one pure function from what the fleet shows now, and the policy's own
state, to the number of workers a model should have, and the next state. `llmq autoscale` calls it
every tick per model (stack/autoscaler.py); the replay calls it in simulated time
(llmq/autoscale/replay.py). Nothing here reads a clock or Redis.

How it decides, and whose ideas it takes:

1. Demand is every request of the model not yet finished: queued (the broker's lists at every
   priority, and work parked for its tenant's turn) plus in flight on the workers (running and
   waiting in their engines). As Ray Serve sizes a deployment by its ongoing requests against
   `target_ongoing_requests`, and as the Kubernetes HPA sizes by ceil(current * metric / target),
   the workers it asks for are ceil(demand / target_ongoing).
2. The arrival rate and the completion rate (completions: what arrived, less what the demand
   grew by), each smoothed with a half-life, say whether demand is growing; if it is, the
   policy sizes for the demand one worker start-up from now, since a worker started now serves
   only then.
3. Within a tolerance of what the current workers are sized for, it asks for no change (HPA's
   tolerance), so noise at a boundary does not keep a decision pending.
4. The count is bounded by LLMQ_AUTOSCALE_MIN and LLMQ_AUTOSCALE_MAX, and never below what the
   traffic profile keeps warm. That floor acts at once: it is a plan, not a noisy measurement.
5. A decision to change acts only once it has held for the upscale or downscale delay, every
   tick in the same direction (Ray Serve's upscale_delay_s and downscale_delay_s; a tick that
   asks for no change, or the other way, starts the wait over). It then moves to the safest count
   asked for while it held, the fewest workers for a scale-up and the most for a scale-down (the
   HPA's stabilization window keeps the highest recommendation for a scale-down likewise).
6. With no worker at all and demand waiting, it starts workers at once (Ray Serve's cold-start
   path): nothing serves the waiting requests, so there is no noise to wait out.

Starting workers count as workers: they will serve soon, and counting only ready ones would start
more at every tick of a long start-up. (The HPA, too, keeps a pod that is not yet ready among the
replicas and takes its usage as none when it scales up, so a start-up in progress damps the next
scale-up.)

References: Ray Serve, "Advanced Ray Serve Autoscaling" (docs.ray.io/en/latest/serve/advanced-guides/
advanced-autoscaling.html) and ray.serve.config.AutoscalingConfig; Kubernetes, "Horizontal Pod
Autoscaling", algorithm details and the behavior field's stabilizationWindowSeconds
(kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from llmq.autoscale.config import PolicyConfig

UP, DOWN = 1, -1


@dataclass(frozen=True)
class Observation:
    """What the fleet shows now, for one model.

    now          seconds on any clock that only moves forward
    queued       requests waiting for a worker
    in_flight    requests on the workers (running, or waiting in their engines)
    arrivals     requests that arrived since the previous observation
    workers      workers counted: starting or ready, not draining
    warm         workers the traffic profile keeps warm now (read one start-up ahead)
    startup_s    a worker's start-up time, measured or assumed
    """

    now: float
    queued: int
    in_flight: int
    arrivals: int
    workers: int
    warm: int = 0
    startup_s: float = 0.0

    @property
    def demand(self) -> int:
        return self.queued + self.in_flight


@dataclass(frozen=True)
class Pending:
    """A decision to change the count that has not yet held long enough: its direction, when it
    first appeared, and the safest count asked for since (fewest for UP, most for DOWN)."""

    direction: int
    since: float
    workers: int


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between observations; PolicyState() before the first."""

    last_now: float | None = None
    last_demand: int = 0
    arrival_rate: float = 0.0  # requests per second, smoothed
    completion_rate: float = 0.0
    pending: Pending | None = None


@dataclass(frozen=True)
class Decision:
    desired: int  # the workers the model should have now
    recommended: int  # what this observation alone asks for, within the bounds
    reason: str
    state: PolicyState


def decide(obs: Observation, state: PolicyState, config: PolicyConfig) -> Decision:
    """The desired workers for `obs` and the next state. min_workers <= desired <= max_workers,
    desired >= the profile's warm workers (capped at max_workers), and desired differs from
    obs.workers only when the floor asks for more, on a cold start, or once a decision held for its
    delay."""
    state = _rates(obs, state, config)
    growth = max(0.0, state.arrival_rate - state.completion_rate)
    projected = obs.demand + growth * obs.startup_s
    wanted = _workers_for(projected, obs.workers, config)
    floor = min(config.max_workers, max(config.min_workers, obs.warm))
    recommended = min(config.max_workers, max(floor, wanted))
    why = _why(obs, growth, projected, wanted, floor, recommended, config)

    pending = state.pending
    if recommended == obs.workers:
        desired, pending, note = obs.workers, None, ""
    elif obs.workers == 0 and obs.demand > 0:
        desired, pending, note = recommended, None, "; no worker serves the waiting requests, so at once"
    else:
        direction = UP if recommended > obs.workers else DOWN
        if pending is None or pending.direction != direction:
            pending = Pending(direction, obs.now, recommended)
        else:
            safest = min if direction == UP else max
            pending = replace(pending, workers=safest(pending.workers, recommended))
        delay = config.upscale_delay_s if direction == UP else config.downscale_delay_s
        held = obs.now - pending.since
        if held >= delay:
            desired, note = pending.workers, f"; held {held:.0f} s (delay {delay:g} s)"
            pending = None
        else:
            desired, note = obs.workers, f"; pending for {held:.0f} of {delay:g} s"
    if desired < floor:  # a scale-up still pending above the floor keeps waiting
        desired, note = floor, "; the floor acts at once"
    return Decision(desired, recommended, why + note, replace(state, pending=pending))


def _rates(obs: Observation, state: PolicyState, config: PolicyConfig) -> PolicyState:
    """The smoothed arrival and completion rates moved on by this observation."""
    if state.last_now is None:  # nothing to take a rate over yet
        return replace(state, last_now=obs.now, last_demand=obs.demand)
    if obs.now <= state.last_now:
        return state
    dt = obs.now - state.last_now
    keep = 0.5 ** (dt / config.rate_half_life_s)  # the old value's weight after dt, whatever the tick
    completions = max(0, obs.arrivals + state.last_demand - obs.demand)
    return replace(state, last_now=obs.now, last_demand=obs.demand,
                   arrival_rate=keep * state.arrival_rate + (1 - keep) * obs.arrivals / dt,
                   completion_rate=keep * state.completion_rate + (1 - keep) * completions / dt)


def _workers_for(projected: float, workers: int, config: PolicyConfig) -> int:
    if workers > 0 and abs(projected / (workers * config.target_ongoing) - 1) <= config.tolerance:
        return workers
    return math.ceil(projected / config.target_ongoing)


def _why(obs: Observation, growth: float, projected: float, wanted: int, floor: int, recommended: int,
         config: PolicyConfig) -> str:
    text = f"{obs.demand} requests ({obs.queued} queued, {obs.in_flight} on workers)"
    if growth > 0 and obs.startup_s > 0:
        text += f", {projected:.1f} one start-up ({obs.startup_s:.0f} s) ahead at +{growth:.2f}/s"
    text += f" at {config.target_ongoing} per worker ask for {wanted}"
    if recommended > wanted:
        text += f", raised to {recommended} (" + ("the profile keeps" if floor > config.min_workers else "min")
        text += f" {floor})"
    elif recommended < wanted:
        text += f", capped at {recommended} (max)"
    return text
