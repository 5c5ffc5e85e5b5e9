"""The autoscaler's configuration, validated on creation: the policy's bounds, target and delays
(PolicyConfig), and how the process runs it (AutoscaleConfig: tick, assumed start-up time, traffic
profile, backend). Built from the settings (LLMQ_AUTOSCALE_*); a bad value is refused with the
variable that holds it and what it may be."""
from __future__ import annotations

from dataclasses import dataclass

from llmq.autoscale.profile import Predict, Profile, parse_profile
from llmq.settings import Settings

BACKENDS = ("local",)


@dataclass(frozen=True)
class PolicyConfig:
    """What llmq/autoscale/policy.py decides with.

    min_workers / max_workers   the bounds of the desired count (min may be 0: scale to zero)
    target_ongoing              requests per worker the fleet is sized for, queued ones included
                                (Ray Serve's target_ongoing_requests); by default the engine's
                                max_num_seqs, so a full fleet runs every request it holds
    upscale_delay_s             how long a decision to add workers must hold before it acts
    downscale_delay_s           how long a decision to remove workers must hold
    rate_half_life_s            the half-life of the smoothed arrival and completion rates
    tolerance                   a load within this fraction of what the workers are sized for
                                changes nothing (HPA's tolerance), so noise at a boundary does not
                                keep a decision pending
    """

    min_workers: int = 1
    max_workers: int = 1
    target_ongoing: int = 128
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    rate_half_life_s: float = 30.0
    tolerance: float = 0.1

    def __post_init__(self):
        if self.min_workers < 0:
            raise ValueError(f"LLMQ_AUTOSCALE_MIN is {self.min_workers}: it must be 0 or more "
                             "(0 lets a model scale to zero workers)")
        if self.max_workers < max(1, self.min_workers):
            raise ValueError(f"LLMQ_AUTOSCALE_MAX is {self.max_workers}: it must be at least 1 and at least "
                             f"LLMQ_AUTOSCALE_MIN ({self.min_workers})")
        if self.target_ongoing < 1:
            raise ValueError(f"LLMQ_AUTOSCALE_TARGET_ONGOING is {self.target_ongoing}: it must be at least 1 "
                             "(requests per worker; unset, it is LLMQ_MAX_NUM_SEQS)")
        for name, value in (("LLMQ_AUTOSCALE_UPSCALE_DELAY", self.upscale_delay_s),
                            ("LLMQ_AUTOSCALE_DOWNSCALE_DELAY", self.downscale_delay_s)):
            if value < 0:
                raise ValueError(f"{name} is {value}: it must be 0 or more seconds")
        if self.rate_half_life_s <= 0:
            raise ValueError(f"LLMQ_AUTOSCALE_RATE_HALF_LIFE is {self.rate_half_life_s}: it must be at least 1 second")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"the autoscaler's tolerance is {self.tolerance}: it must be in [0, 1)")


@dataclass(frozen=True)
class AutoscaleConfig:
    """How `llmq autoscale` runs the policy.

    tick_s       seconds between two looks at the fleet
    startup_s    a worker's start-up time (process start to serving) until one is measured: how far
                 ahead the profile is read, so pre-warmed workers are ready when their hour begins
    profile      workers kept warm by hour of the week, a prediction of them from the recorded
                 arrivals (Predict), or None (only min_workers are kept)
    backend      what starts and stops workers: "local" (processes on this machine)
    """

    policy: PolicyConfig
    tick_s: float = 5.0
    startup_s: float = 60.0
    profile: Profile | Predict | None = None
    backend: str = "local"

    def __post_init__(self):
        if self.tick_s < 1:
            raise ValueError(f"LLMQ_AUTOSCALE_TICK_SECONDS is {self.tick_s}: it must be at least 1 second")
        if self.startup_s < 0:
            raise ValueError(f"LLMQ_AUTOSCALE_STARTUP_SECONDS is {self.startup_s}: it must be 0 or more seconds")
        if self.backend not in BACKENDS:
            raise ValueError(f"LLMQ_AUTOSCALE_BACKEND is {self.backend!r}: it must be one of {', '.join(BACKENDS)} "
                             "(Kubernetes scales with KEDA instead: see deploy/)")


def autoscale_config(settings: Settings) -> AutoscaleConfig:
    """The autoscaler's configuration from the settings; a ValueError says which setting is wrong."""
    policy = PolicyConfig(
        min_workers=settings.autoscale_min, max_workers=settings.autoscale_max,
        target_ongoing=settings.autoscale_target_ongoing or settings.max_num_seqs,
        upscale_delay_s=settings.autoscale_upscale_delay, downscale_delay_s=settings.autoscale_downscale_delay,
        rate_half_life_s=settings.autoscale_rate_half_life)
    profile = parse_profile(settings.autoscale_profile) if settings.autoscale_profile else None
    return AutoscaleConfig(policy=policy, tick_s=settings.autoscale_tick_seconds,
                           startup_s=settings.autoscale_startup_seconds, profile=profile,
                           backend=settings.autoscale_backend)
