"""`llmq autoscale`: every tick, per model, look at the fleet as Redis shows it (llmq/fleet.py) and
at the arrivals the database recorded, ask the policy (llmq/autoscale/policy.py) how many workers
the model should have, start or stop workers through the backend to get there, and publish the
decision (llmq.fleet.write_autoscaler; the web's /metrics and its "is this model served" check read
it). Every start and stop is logged with its reason.

What it counts as a model's workers: those whose heartbeats are live and not draining, and those it
started that have not sent one yet (still loading). A scale-down stops the idlest of its own
workers (fewest running and waiting in its last heartbeat; one still starting holds nothing) with
a SIGTERM, so the worker hands its requests back; a worker that exits on its own (a crash) is
simply no longer counted, and the policy replaces it like any missing worker. Workers it did not
start (another autoscaler's, the Procfile's `worker`) are counted, never stopped.

The start-up time of each worker it starts (process start to ready) is measured, logged, and used
as the look-ahead for pre-warming from then on.
"""
from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

import redis
from sqlalchemy.exc import SQLAlchemyError

from llmq import fleet, fleet_history
from llmq.autoscale.config import AutoscaleConfig
from llmq.autoscale.policy import Decision, Observation, PolicyState, decide
from llmq.autoscale.predict import predict_profile, spans_of
from llmq.autoscale.profile import SECONDS_PER_WEEK, Predict, Profile
from llmq.events import AUTOSCALER_KEY
from llmq.store.arrivals import arrivals_between, batch_stays, request_stays
from llmq.store.database import Database
from stack.worker_backends import WorkerBackend, WorkerProcess

log = logging.getLogger("llmq.autoscaler")
PREDICT_EVERY_S = 3600  # a predicted profile is made again this often


class Autoscaler:
    def __init__(self, config: AutoscaleConfig, backend: WorkerBackend, models: list[str], client: redis.Redis,
                 db: Database, stale_after: float):
        self.config = config
        self.backend = backend
        self.models = models
        self.client = client
        self.db = db
        self.stale_after = stale_after
        self.startup_s = config.startup_s  # assumed until a worker's start-up is measured
        self.startup_measured: list[float] = []
        self.states = {model: PolicyState() for model in models}
        self._arrivals_since = {model: time.time() for model in models}
        self._ready: set[str] = set()  # own workers seen ready
        self._profiles: dict[str, tuple[float, Profile]] = {}  # model -> (made at, predicted profile)

    # ---- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        log.info("autoscaling %s with the %s backend: %d to %d workers each, %d requests per worker, delays "
                 "%g s up and %g s down, a tick every %g s%s", ", ".join(self.models), self.backend.name,
                 self.config.policy.min_workers, self.config.policy.max_workers, self.config.policy.target_ongoing,
                 self.config.policy.upscale_delay_s, self.config.policy.downscale_delay_s, self.config.tick_s,
                 self._profile_note())
        while not stop.is_set():
            try:
                self.tick()
            except redis.RedisError as err:  # away for a while: the next tick tries again
                log.warning("tick failed: %s", err)
            stop.wait(self.config.tick_s)

    def close(self, timeout: float) -> None:
        """Stop every worker it started (each hands its work back), and withdraw its decisions."""
        running = self.backend.workers()
        if running:
            log.info("stopping its %d worker(s): %s", len(running), ", ".join(w.name for w in running))
        self.backend.close(timeout)
        self._reap()
        try:
            self.client.hdel(AUTOSCALER_KEY, *self.models)
        except redis.RedisError:
            pass

    def tick(self, now: float | None = None) -> dict[str, Decision]:
        now = time.time() if now is None else now
        self._reap()
        return {model: self._tick_model(model, now) for model in self.models}

    # ---- one model -------------------------------------------------------------------------

    def _tick_model(self, model: str, now: float) -> Decision:
        beats = {beat["name"].split("@")[0]: beat for beat in fleet.live_workers(self.client, self.stale_after, model)}
        own = {w.name: w for w in self.backend.workers(model)}
        self._note_ready(own, beats)
        serving = [name for name, beat in beats.items()
                   if beat.get("state", "ready") != "draining" and not _stopping(own.get(name))]
        starting = [name for name, worker in own.items() if name not in beats and not _stopping(worker)]
        workers = len(serving) + len(starting)
        observation = Observation(
            now=now, queued=sum(fleet.queue_depth(self.client, model).values()),
            in_flight=sum(beat.get("running", 0) + beat.get("waiting", 0) for beat in beats.values()),
            arrivals=self._arrivals(model, now), workers=workers, warm=self._warm(model, now),
            startup_s=self.startup_s)
        decision = decide(observation, self.states[model], self.config.policy)
        self.states[model] = decision.state
        log.debug("%s: %d workers, %d wanted: %s", model, workers, decision.desired, decision.reason)
        if decision.desired > workers:
            for _ in range(decision.desired - workers):
                started = self.backend.start(model)
                log.info("%s: started worker %s (pid %d) at %.3f, %d -> %d workers: %s", model, started.name,
                         started.pid, started.started_at, workers, decision.desired, decision.reason)
        elif decision.desired < workers:
            self._stop_idlest(model, workers - decision.desired, own, beats, workers, decision)
        fleet.write_autoscaler(self.client, model, {
            "desired": decision.desired, "actual": workers, "min": self.config.policy.min_workers,
            "max": self.config.policy.max_workers, "backend": self.backend.name, "queued": observation.queued,
            "in_flight": observation.in_flight, "arrival_rate": round(decision.state.arrival_rate, 4),
            "startup_s": round(self.startup_s, 1)})
        fleet_history.record(self.client, model, self.stale_after, now)  # the dashboard's chart, when no worker runs too
        return decision

    def _stop_idlest(self, model: str, count: int, own: dict[str, WorkerProcess], beats: dict[str, dict],
                     workers: int, decision: Decision) -> None:
        def load(worker: WorkerProcess) -> tuple:
            beat = beats.get(worker.name)
            # Idlest first; of equal load, one still starting (it serves nothing yet), then the newest.
            return ((beat.get("running", 0) + beat.get("waiting", 0)) if beat else 0, beat is not None,
                    -worker.started_at)

        candidates = sorted((w for w in own.values() if not _stopping(w)), key=load)
        for worker in candidates[:count]:
            beat = beats.get(worker.name)
            held = f"{beat.get('running', 0)} running, {beat.get('waiting', 0)} waiting" if beat else "still starting"
            self.backend.stop(worker.name)
            log.info("%s: stopping worker %s (%s; it hands its requests back), %d -> %d workers: %s", model,
                     worker.name, held, workers, decision.desired, decision.reason)
        if len(candidates) < count:
            log.warning("%s: %d worker(s) too many, but only %d of them were started here; the others are "
                        "left running", model, count, len(candidates))

    # ---- what it measures ------------------------------------------------------------------

    def _note_ready(self, own: dict[str, WorkerProcess], beats: dict[str, dict]) -> None:
        for name, worker in own.items():
            beat = beats.get(name)
            if name in self._ready or beat is None or beat.get("state", "ready") != "ready":
                continue
            self._ready.add(name)
            # The heartbeat says when the engine became ready, where it says it; else its first heartbeat.
            ready_at = beat.get("ready_at") or beat.get("at", time.time())
            seconds = max(0.0, ready_at - worker.started_at)
            self.startup_measured.append(seconds)
            recent = self.startup_measured[-5:]
            self.startup_s = sum(recent) / len(recent)
            log.info("%s: worker %s ready %.1f s after its process started (start-up now taken as %.1f s)",
                     worker.model, name, seconds, self.startup_s)

    def _reap(self) -> None:
        for worker in self.backend.reap():
            self._ready.discard(worker.name)
            lived = time.time() - worker.started_at
            if worker.stopping_since is not None:
                log.info("%s: worker %s exited (code %s) %.1f s after it was told to stop", worker.model,
                         worker.name, worker.exit_code, time.time() - worker.stopping_since)
            else:
                log.warning("%s: worker %s exited on its own (code %s) after %.0f s; it is no longer counted"
                            + (f" (see {worker.log_path})" if worker.log_path else ""), worker.model, worker.name,
                            worker.exit_code, lived)

    def _arrivals(self, model: str, now: float) -> int:
        """Arrivals since the last tick; none counted while the database does not answer (the queue
        and the workers, in Redis, still size the fleet)."""
        since = self._arrivals_since[model]
        try:
            with self.db.read() as session:
                arrivals = arrivals_between(session, model, since, now)
        except SQLAlchemyError as err:
            log.warning("%s: could not count the arrivals (%s); sizing from the queue and the workers alone",
                        model, _first_line(err))
            return 0
        self._arrivals_since[model] = now
        return arrivals

    def _warm(self, model: str, now: float) -> int:
        profile = self._profile(model, now)
        return profile.peak(datetime.fromtimestamp(now), self.startup_s) if profile is not None else 0

    def _profile(self, model: str, now: float) -> Profile | None:
        profile = self.config.profile
        if not isinstance(profile, Predict):
            return profile
        made = self._profiles.get(model)
        if made is None or now - made[0] >= PREDICT_EVERY_S:
            since = now - profile.weeks * SECONDS_PER_WEEK
            try:
                with self.db.read() as session:
                    spans = spans_of(request_stays(session, model, since, now),
                                     batch_stays(session, model, since, now), now)
            except SQLAlchemyError as err:  # the last prediction holds (none yet: nothing kept warm)
                log.warning("%s: could not read the past arrivals to predict the profile (%s)", model,
                            _first_line(err))
                self._profiles[model] = made = (now, made[1] if made else Profile(()))
                return made[1]
            predicted = predict_profile(spans, now, profile.weeks, self.config.policy.target_ongoing)
            if made is None or made[1].windows != predicted.windows:
                log.info("%s: profile %s", model, predicted.describe())
            self._profiles[model] = made = (now, predicted)
        return made[1]

    def _profile_note(self) -> str:
        profile = self.config.profile
        if profile is None:
            return ""
        if isinstance(profile, Predict):
            return f"; workers kept warm as predicted from the past {profile.weeks} week(s)"
        return f"; workers kept warm: {profile.describe()}"


def _stopping(worker: WorkerProcess | None) -> bool:
    return worker is not None and worker.stopping_since is not None


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__
