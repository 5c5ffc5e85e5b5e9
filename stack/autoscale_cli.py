"""`llmq autoscale`: run the autoscaler (stack/autoscaler.py) until SIGTERM or Ctrl-C, then stop the
workers it started; or, with --replay, run an arrival trace through the policy in simulated time and
print (and --plot) what the fleet would have done.

    llmq autoscale                                   scale MODEL_NAME's workers (LLMQ_AUTOSCALE_* settings)
    llmq autoscale --model a=/models/a --model b=/models/b
    llmq autoscale --replay synthetic --plot fleet.png [--max-workers 6 ...]
    llmq autoscale --replay trace.csv | --replay database [--hours 168]
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

log = logging.getLogger("llmq.autoscaler")


def add_autoscale_command(commands) -> None:
    parser = commands.add_parser("autoscale", help="start and stop workers from each model's queue and arrivals, "
                                                   "or --replay a trace through the policy")
    parser.add_argument("--model", action="append", metavar="NAME=PATH",
                        help="a model to scale and its folder (repeatable; default: MODEL_NAME and MODEL_PATH)")
    parser.add_argument("--log-dir", help="where each worker's log goes (default: LLMQ_HOME/logs)")
    replay = parser.add_argument_group("replay (simulated time; nothing is started)")
    replay.add_argument("--replay", metavar="SOURCE",
                        help="'synthetic' (a seeded morning), 'database' (the recorded arrivals), or a CSV trace "
                             "file (time[,count] per line)")
    replay.add_argument("--plot", metavar="PNG", help="draw arrivals, queue and workers against time")
    replay.add_argument("--hours", type=float, default=24.0, help="with --replay database: hours back (default 24)")
    replay.add_argument("--seed", type=int, default=0, help="with --replay synthetic")
    replay.add_argument("--startup", type=float, help="a simulated worker's start-up in seconds "
                                                      "(default: LLMQ_AUTOSCALE_STARTUP_SECONDS)")
    replay.add_argument("--throughput", type=float, default=0.5,
                        help="requests a simulated worker finishes per second when full (default 0.5)")
    replay.add_argument("--min-workers", type=int, help="instead of LLMQ_AUTOSCALE_MIN")
    replay.add_argument("--max-workers", type=int, help="instead of LLMQ_AUTOSCALE_MAX")
    replay.add_argument("--target-ongoing", type=int, help="instead of LLMQ_AUTOSCALE_TARGET_ONGOING")
    replay.add_argument("--upscale-delay", type=float, help="instead of LLMQ_AUTOSCALE_UPSCALE_DELAY")
    replay.add_argument("--downscale-delay", type=float, help="instead of LLMQ_AUTOSCALE_DOWNSCALE_DELAY")
    replay.add_argument("--profile", help="instead of LLMQ_AUTOSCALE_PROFILE (windows only)")
    parser.set_defaults(func=cmd_autoscale)


def cmd_autoscale(args) -> int:
    from llmq.autoscale.config import autoscale_config
    from llmq.settings import Settings

    settings = Settings.from_env()
    config = autoscale_config(settings)
    if args.replay:
        return _replay(args, settings, config)
    return _run(args, settings, config)


def _run(args, settings, config) -> int:
    from llmq.bootstrap import bootstrap
    from llmq.redis_client import redis_client
    from llmq.store.database import Database
    from stack.autoscaler import Autoscaler
    from stack.worker_backends import LocalBackend

    settings = bootstrap(settings)
    models = dict(_model_arg(text) for text in args.model or ())
    if not models:
        models = {settings.resolved_model_name(): settings.model_path}
    # The workers get this process's environment, with the Redis and model it settled on, so none
    # of them bootstraps its own.
    base_env = {**os.environ, "REDIS_URL": settings.redis_url, "DATABASE_URL": settings.database_url}

    def env_of(model: str) -> dict[str, str]:
        return {**base_env, "MODEL_NAME": model, "MODEL_PATH": models[model]}

    log_dir = Path(args.log_dir) if args.log_dir else settings.home / "logs"
    backend = LocalBackend(env_of, log_dir)
    autoscaler = Autoscaler(config, backend, list(models), redis_client(settings.redis_url,
                                                                           settings.redis_retry_seconds),
                            Database(settings.database_url), stale_after=settings.lease_seconds)
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    log.info("workers log to %s", log_dir)
    try:
        autoscaler.run(stop)
    finally:
        autoscaler.close(timeout=settings.shutdown_grace_seconds + 15)
    return 0


def _model_arg(text: str) -> tuple[str, str]:
    name, _, path = text.partition("=")
    if not name or not path:
        raise ValueError(f"--model takes NAME=PATH (the name clients send, and the model's folder), got {text!r}")
    if not Path(path).is_dir():
        raise ValueError(f"--model {text}: {path} is not a folder")
    return name, path


def _replay(args, settings, config) -> int:
    from llmq.autoscale.plot import plot_replay
    from llmq.autoscale.profile import Predict, parse_profile
    from llmq.autoscale.replay import FleetModel, replay

    overrides = {field: value for field, value in (
        ("min_workers", args.min_workers), ("max_workers", args.max_workers),
        ("target_ongoing", args.target_ongoing), ("upscale_delay_s", args.upscale_delay),
        ("downscale_delay_s", args.downscale_delay)) if value is not None}
    policy = replace(config.policy, **overrides)
    profile = parse_profile(args.profile) if args.profile else config.profile
    if isinstance(profile, Predict):
        raise ValueError("a replay takes a profile of windows (--profile 'mon-fri 08-18=3'), not 'predict'")
    trace = _trace(args, settings)
    fleet_model = FleetModel(startup_s=config.startup_s if args.startup is None else args.startup,
                             throughput=args.throughput, slots=settings.max_num_seqs)
    started = time.monotonic()
    result = replay(trace, policy, fleet_model, tick_s=config.tick_s, profile=profile)
    print(f"replay of {trace.name or 'the trace'} ({time.monotonic() - started:.1f} s): {result.summary()}")
    print(f"policy: {policy.min_workers} to {policy.max_workers} workers, {policy.target_ongoing} requests per worker, "
          f"delays {policy.upscale_delay_s:g} s up and {policy.downscale_delay_s:g} s down; simulated workers start "
          f"in {fleet_model.startup_s:g} s and finish {fleet_model.throughput:g} requests/s each with "
          f"{fleet_model.slots} slots" + (f"; profile {profile.describe()}" if profile else ""))
    if args.plot:
        title = (f"{trace.name}: {policy.min_workers}-{policy.max_workers} workers, {policy.target_ongoing} per "
                 f"worker, delays {policy.upscale_delay_s:g} s / {policy.downscale_delay_s:g} s, start-up "
                 f"{fleet_model.startup_s:g} s" + (f"\nkept warm: {profile.describe()}" if profile else ""))
        print(f"plot: {plot_replay(result, args.plot, title=title)}")
    return 0


def _trace(args, settings):
    from llmq.autoscale.trace import Trace, read_trace, synthetic_trace

    if args.replay == "synthetic":
        return synthetic_trace(args.seed)
    if args.replay == "database":
        from sqlalchemy.exc import SQLAlchemyError

        from llmq.store.arrivals import arrival_times
        from llmq.store.database import Database

        until = time.time()
        since = until - args.hours * 3600
        model = settings.model_name or (Path(settings.model_path).name if settings.model_path else None)
        if model is None:
            raise ValueError("--replay database needs the model: set MODEL_NAME (or MODEL_PATH)")
        try:
            with Database(settings.database_url).read() as session:
                times = arrival_times(session, model, since, until)
        except SQLAlchemyError as err:
            raise ValueError(f"--replay database: could not read the arrivals from {settings.database_url} "
                             f"({str(err).splitlines()[0]}); is DATABASE_URL right, and migrated (alembic upgrade "
                             "head)?") from None
        return Trace(tuple(t - since for t in times), since, name=f"{model}, the past {args.hours:g} h")
    if not Path(args.replay).is_file():
        raise ValueError(f"--replay {args.replay}: not 'synthetic', 'database', or a trace file")
    return read_trace(args.replay)
