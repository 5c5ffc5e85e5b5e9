"""A replay: an arrival trace run through the policy in simulated time, against a simple simulated
fleet, to see what a configuration would do before it runs (`llmq autoscale --replay`).

The simulated fleet: a worker is ready `startup_s` after it is started; a ready worker holds up to
`slots` requests and finishes requests at `throughput` per second when all its slots are full (in
proportion when fewer are); the rest queue. Stopping a worker hands its requests back to the queue
(as a SIGTERM does), so the simulation, like the fleet, loses none. Each tick the arrivals of the
tick join, the policy observes (as `llmq autoscale` does: queued, in flight, arrivals, workers
starting or ready), and the fleet is scaled to what it decides.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from datetime import datetime

from llmq.autoscale.config import PolicyConfig
from llmq.autoscale.policy import Observation, PolicyState, decide
from llmq.autoscale.profile import Profile
from llmq.autoscale.trace import Trace


@dataclass(frozen=True)
class FleetModel:
    startup_s: float = 60.0  # start to ready
    throughput: float = 0.5  # requests finished per second by one ready worker with every slot full
    slots: int = 16  # requests one worker holds at once

    def __post_init__(self):
        if self.startup_s < 0 or self.throughput <= 0 or self.slots < 1:
            raise ValueError(f"a simulated worker needs a start-up of 0 s or more, a throughput above 0 and at "
                             f"least one slot; got {self}")


@dataclass
class SimulatedFleet:
    model: FleetModel
    ready_at: list[float] = field(default_factory=list)  # one per worker, in the order started
    demand: int = 0  # requests in the system, queued or in flight
    _credit: float = 0.0  # the part of a request served but not yet finished

    def ready(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now)

    def in_flight(self, now: float) -> int:
        return min(self.demand, self.ready(now) * self.model.slots)

    def serve(self, now: float, dt: float) -> int:
        """Serve for `dt` seconds with the workers ready at `now`; returns the requests finished."""
        self._credit += self.in_flight(now) * self.model.throughput / self.model.slots * dt
        finished = min(self.demand, math.floor(self._credit))
        self._credit = self._credit - finished if self.demand > finished else 0.0
        self.demand -= finished
        return finished

    def scale_to(self, workers: int, now: float) -> None:
        """Start workers, or stop the idlest: one still starting (it holds nothing), else the newest."""
        while len(self.ready_at) < workers:
            self.ready_at.append(now + self.model.startup_s)
        while len(self.ready_at) > workers:
            starting = [i for i, t in enumerate(self.ready_at) if t > now]
            self.ready_at.pop(starting[-1] if starting else len(self.ready_at) - 1)


@dataclass(frozen=True)
class Sample:
    t: float  # seconds from the trace's start
    arrivals: int  # in the tick that ended at t
    queued: int
    in_flight: int
    workers: int  # starting or ready, after the tick's decision
    ready: int
    desired: int
    warm: int = 0  # what the profile kept warm


@dataclass(frozen=True)
class ReplayResult:
    samples: tuple[Sample, ...]
    tick_s: float
    start: float | None = None  # the unix time of second 0, if the trace was of clock times

    @property
    def arrivals(self) -> int:
        return sum(s.arrivals for s in self.samples)

    @property
    def peak_workers(self) -> int:
        return max((s.workers for s in self.samples), default=0)

    @property
    def worker_seconds(self) -> float:
        return sum(s.workers for s in self.samples) * self.tick_s

    @property
    def mean_wait_s(self) -> float:
        """A request's mean wait for a worker slot (Little's law: the queue's area over the arrivals)."""
        return sum(s.queued for s in self.samples) * self.tick_s / self.arrivals if self.arrivals else 0.0

    def summary(self) -> str:
        last = self.samples[-1] if self.samples else None
        seconds = len(self.samples) * self.tick_s
        span = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
        return (f"{self.arrivals} arrivals over {span}: peak {self.peak_workers} "
                f"workers, {self.worker_seconds / 3600:.2f} worker-hours, mean wait for a slot "
                f"{self.mean_wait_s:.1f} s, peak queue {max((s.queued for s in self.samples), default=0)}"
                + (f"; at the end {last.workers} worker(s), {last.queued + last.in_flight} unfinished" if last else ""))


def replay(trace: Trace, config: PolicyConfig, fleet_model: FleetModel, tick_s: float = 5.0,
           profile: Profile | None = None, settle_s: float | None = None) -> ReplayResult:
    """Run `trace` through the policy. The fleet starts with the floor's workers ready; the replay
    runs to the last arrival, then until every request is done and the fleet is back at its minimum,
    or `settle_s` more seconds (default: twice the downscale delay and an hour)."""
    fleet = SimulatedFleet(fleet_model)
    start = trace.start

    def warm(t: float) -> int:
        if profile is None or start is None:
            return 0
        return profile.peak(datetime.fromtimestamp(start + t), fleet_model.startup_s)

    floor = min(config.max_workers, max(config.min_workers, warm(0)))
    fleet.ready_at = [0.0] * floor
    state, samples = PolicyState(), []
    times = trace.times
    last_arrival = times[-1] if times else 0.0
    settle_s = 2 * config.downscale_delay_s + 3600 if settle_s is None else settle_s
    t, seen = 0.0, 0
    while True:
        fleet.serve(t, tick_s)
        t += tick_s
        upto = bisect_right(times, t)
        arrivals, seen = upto - seen, upto
        fleet.demand += arrivals
        observation = Observation(now=t, queued=fleet.demand - fleet.in_flight(t), in_flight=fleet.in_flight(t),
                                  arrivals=arrivals, workers=len(fleet.ready_at), warm=warm(t),
                                  startup_s=fleet_model.startup_s)
        decision = decide(observation, state, config)
        state = decision.state
        fleet.scale_to(decision.desired, t)
        samples.append(Sample(t, arrivals, observation.queued, observation.in_flight, len(fleet.ready_at),
                              fleet.ready(t), decision.desired, observation.warm))
        settled = fleet.demand == 0 and len(fleet.ready_at) <= config.min_workers
        if t >= last_arrival and (settled or t >= last_arrival + settle_s):
            break
    return ReplayResult(tuple(samples), tick_s, start)
