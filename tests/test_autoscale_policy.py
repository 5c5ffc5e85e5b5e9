"""The autoscaling policy (llmq/autoscale/policy.py), exactly: the count it asks for, the delays, the
safest count while a decision held, the floor, the cold start, the smoothed rates."""
from __future__ import annotations

import random

import pytest

from llmq.autoscale.config import AutoscaleConfig, PolicyConfig, autoscale_config
from llmq.autoscale.policy import DOWN, UP, Observation, Pending, PolicyState, decide
from llmq.settings import Settings

CONFIG = PolicyConfig(min_workers=1, max_workers=3, target_ongoing=4, upscale_delay_s=1, downscale_delay_s=10,
                      rate_half_life_s=1)


def run(observations, config=CONFIG, state=None):
    """Each observation through the policy in turn: the desired counts, and the last state."""
    state = state or PolicyState()
    desired = []
    for obs in observations:
        decision = decide(obs, state, config)
        desired.append(decision.desired)
        state = decision.state
    return desired, state


def obs(now, queued=0, in_flight=0, workers=1, arrivals=0, **kw):
    return Observation(now=now, queued=queued, in_flight=in_flight, arrivals=arrivals, workers=workers, **kw)


def test_a_burst_scales_up_once_the_decision_held_for_the_upscale_delay():
    first = decide(obs(0, queued=16), PolicyState(), CONFIG)
    assert (first.desired, first.recommended) == (1, 3)  # 16 / 4 = 4, capped at max 3
    assert first.state.pending == Pending(UP, 0, 3)
    assert "capped at 3" in first.reason and "pending" in first.reason
    half = decide(obs(0.5, queued=16), first.state, CONFIG)
    assert half.desired == 1
    held = decide(obs(1.0, queued=16), half.state, CONFIG)
    assert held.desired == 3 and held.state.pending is None


def test_a_scale_up_moves_to_the_fewest_workers_asked_for_while_it_held():
    desired, _ = run([obs(0, queued=12), obs(0.5, queued=6), obs(1.0, queued=12)])
    assert desired == [1, 1, 2]  # 3, then 2 (6 / 4), then 3 again: it acts on 2


def test_a_tick_asking_for_no_change_starts_the_wait_over():
    desired, state = run([obs(0, queued=12), obs(0.5, queued=4), obs(1.0, queued=12), obs(1.5, queued=12),
                          obs(2.0, queued=12)])
    assert desired == [1, 1, 1, 1, 3]  # the wait began again at 1.0
    assert state.pending is None


def test_an_upscale_delay_of_zero_acts_at_once():
    config = PolicyConfig(min_workers=1, max_workers=8, target_ongoing=4, upscale_delay_s=0, downscale_delay_s=0)
    assert decide(obs(0, queued=20), PolicyState(), config).desired == 5


def test_scale_down_waits_for_the_downscale_delay_and_keeps_the_most_asked_for():
    ticks = [obs(t, workers=3) for t in range(0, 5)] + [obs(5, in_flight=7, workers=3)] + \
            [obs(t, workers=3) for t in range(6, 11)]
    desired, state = run(ticks)
    # 0 requests ask for 1 (the minimum); at 5 s, 7 requests ask for 2: the safest count held is 2.
    assert desired == [3] * 10 + [2]
    assert state.pending is None


def test_scale_down_to_the_minimum_after_an_idle_delay():
    desired, _ = run([obs(t, workers=3) for t in range(0, 11)] + [obs(11, workers=1)])
    assert desired == [3] * 10 + [1, 1]


def test_a_change_of_direction_restarts_the_delay():
    desired, state = run([obs(0, workers=2), obs(4, workers=2, queued=12), obs(5, workers=2)])
    assert desired == [2, 2, 2]
    assert state.pending == Pending(DOWN, 5, 1)


def test_with_no_worker_a_waiting_request_starts_one_at_once():
    config = PolicyConfig(min_workers=0, max_workers=3, target_ongoing=4, upscale_delay_s=30, downscale_delay_s=10)
    idle = decide(obs(0, workers=0), PolicyState(), config)
    assert idle.desired == 0
    arrived = decide(obs(1, queued=1, workers=0, arrivals=1), idle.state, config)
    assert arrived.desired == 1 and "at once" in arrived.reason
    burst = decide(obs(2, queued=9, workers=0), arrived.state, config)
    assert burst.desired == 3


def test_min_zero_scales_to_zero_after_the_downscale_delay():
    config = PolicyConfig(min_workers=0, max_workers=3, target_ongoing=4, upscale_delay_s=1, downscale_delay_s=10)
    desired, _ = run([obs(t, workers=1) for t in range(0, 11)], config)
    assert desired == [1] * 10 + [0]


def test_the_profile_floor_acts_at_once_and_is_capped_by_max():
    first = decide(obs(0, workers=1, warm=2), PolicyState(), CONFIG)
    assert first.desired == 2 and "the profile keeps 2" in first.reason
    assert decide(obs(0, workers=1, warm=9), PolicyState(), CONFIG).desired == 3


def test_a_floor_below_a_pending_scale_up_keeps_it_waiting():
    first = decide(obs(0, queued=12, warm=2), PolicyState(), CONFIG)
    assert first.desired == 2 and first.state.pending == Pending(UP, 0, 3)
    assert decide(obs(1, queued=12, warm=2, workers=2), first.state, CONFIG).desired == 3


def test_when_the_profile_window_ends_the_downscale_delay_applies():
    desired, _ = run([obs(0, workers=3, warm=3)] + [obs(t, workers=3) for t in range(1, 12)])
    assert desired == [3] * 11 + [1]


def test_a_load_within_the_tolerance_changes_nothing():
    config = PolicyConfig(min_workers=1, max_workers=8, target_ongoing=4, upscale_delay_s=0, downscale_delay_s=0,
                          tolerance=0.2)
    assert decide(obs(0, queued=9, workers=2), PolicyState(), config).desired == 2  # 9 / 8 = 1.125
    assert decide(obs(0, queued=10, workers=2), PolicyState(), config).desired == 3  # 1.25
    assert decide(obs(0, queued=7, workers=2), PolicyState(), config).desired == 2  # 0.875
    assert decide(obs(0, queued=6, workers=2), PolicyState(), config).desired == 2  # 0.75: ceil(6 / 4) = 2
    assert decide(obs(0, queued=4, workers=2), PolicyState(), config).desired == 1  # 0.5


def test_the_first_observation_sets_no_rate():
    state = decide(obs(100, queued=10, arrivals=10), PolicyState(), CONFIG).state
    assert (state.last_now, state.last_demand, state.arrival_rate, state.completion_rate) == (100, 10, 0.0, 0.0)


def test_the_rates_are_smoothed_by_their_half_life_whatever_the_tick():
    config = PolicyConfig(min_workers=1, max_workers=3, target_ongoing=4, rate_half_life_s=2)
    one = decide(obs(2, arrivals=8, queued=8), PolicyState(last_now=0), config).state
    assert one.arrival_rate == 2.0  # half of 8 / 2 s: one half-life has passed
    two = decide(obs(1, arrivals=4, queued=4), PolicyState(last_now=0), config).state
    three = decide(obs(2, arrivals=4, queued=8), two, config).state
    assert three.arrival_rate == pytest.approx(2.0)  # the same arrivals, in two ticks: the same rate


def test_completions_are_what_arrived_less_what_the_demand_grew_by():
    config = PolicyConfig(min_workers=1, max_workers=3, target_ongoing=4, rate_half_life_s=1)
    first = decide(obs(1, arrivals=10, queued=10), PolicyState(last_now=0), config).state
    assert (first.arrival_rate, first.completion_rate) == (5.0, 0.0)
    second = decide(obs(2, queued=4), first, config).state  # nothing arrived, 6 finished
    assert (second.arrival_rate, second.completion_rate) == (2.5, 3.0)


def test_growing_demand_is_sized_one_start_up_ahead():
    config = PolicyConfig(min_workers=1, max_workers=10, target_ongoing=4, upscale_delay_s=0, rate_half_life_s=1)
    state = PolicyState(last_now=0)
    # 10 arrived in 1 s, none finished: +5 requests/s smoothed; 2 s of start-up ahead, 10 + 10 = 20.
    decision = decide(obs(1, arrivals=10, queued=10, startup_s=2), state, config)
    assert decision.desired == 5
    assert "20.0 one start-up (2 s) ahead" in decision.reason
    # Without a start-up time to look across, the demand as it is: 10 / 4.
    assert decide(obs(1, arrivals=10, queued=10), state, config).desired == 3


def test_shrinking_demand_is_not_projected():
    config = PolicyConfig(min_workers=1, max_workers=10, target_ongoing=4, upscale_delay_s=0, rate_half_life_s=1)
    state = PolicyState(last_now=0, last_demand=20, completion_rate=5.0)
    assert decide(obs(1, queued=12, workers=3, startup_s=10), state, config).desired == 3


def test_the_desired_count_stays_within_the_bounds_and_above_the_floor():
    config = PolicyConfig(min_workers=2, max_workers=6, target_ongoing=3, upscale_delay_s=3, downscale_delay_s=7,
                          rate_half_life_s=5)
    rng = random.Random(0)
    state, workers = PolicyState(), 2
    for tick in range(2000):
        observation = obs(tick, queued=rng.choice([0, 0, 1, 5, 30]), in_flight=rng.randrange(12), workers=workers,
                          arrivals=rng.randrange(20), warm=rng.choice([0, 0, 3, 9]), startup_s=rng.choice([0, 5]))
        decision = decide(observation, state, config)
        assert config.min_workers <= decision.desired <= config.max_workers
        assert decision.desired >= min(observation.warm, config.max_workers)
        if decision.desired != workers:  # it acted on a decision that held, or the floor raised it
            floor = min(config.max_workers, max(config.min_workers, observation.warm))
            assert decision.state.pending is None or decision.desired == floor
        state, workers = decision.state, decision.desired


@pytest.mark.parametrize(("fields", "message"), [
    ({"min_workers": -1}, "LLMQ_AUTOSCALE_MIN is -1"),
    ({"min_workers": 3, "max_workers": 2}, "LLMQ_AUTOSCALE_MAX is 2: it must be at least 1 and at least "
                                           "LLMQ_AUTOSCALE_MIN (3)"),
    ({"max_workers": 0, "min_workers": 0}, "LLMQ_AUTOSCALE_MAX is 0"),
    ({"target_ongoing": 0}, "LLMQ_AUTOSCALE_TARGET_ONGOING is 0"),
    ({"upscale_delay_s": -1}, "LLMQ_AUTOSCALE_UPSCALE_DELAY is -1"),
    ({"downscale_delay_s": -5}, "LLMQ_AUTOSCALE_DOWNSCALE_DELAY is -5"),
    ({"rate_half_life_s": 0}, "LLMQ_AUTOSCALE_RATE_HALF_LIFE is 0"),
])
def test_a_bad_policy_setting_names_its_variable(fields, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        PolicyConfig(**fields)


def test_a_bad_process_setting_names_its_variable():
    with pytest.raises(ValueError, match="LLMQ_AUTOSCALE_BACKEND is 'k8s': it must be one of local"):
        AutoscaleConfig(CONFIG, backend="k8s")
    with pytest.raises(ValueError, match="LLMQ_AUTOSCALE_TICK_SECONDS is 0"):
        AutoscaleConfig(CONFIG, tick_s=0)


def test_the_settings_make_the_config(monkeypatch):
    for name, value in {"LLMQ_AUTOSCALE_MIN": "0", "LLMQ_AUTOSCALE_MAX": "3", "LLMQ_AUTOSCALE_UPSCALE_DELAY": "1",
                        "LLMQ_AUTOSCALE_DOWNSCALE_DELAY": "10", "LLMQ_MAX_NUM_SEQS": "6",
                        "LLMQ_AUTOSCALE_PROFILE": "mon-fri 08-18=2", "LLMQ_AUTOSCALE_TICK_SECONDS": "2"}.items():
        monkeypatch.setenv(name, value)
    config = autoscale_config(Settings.from_env())
    assert config.policy == PolicyConfig(min_workers=0, max_workers=3, target_ongoing=6, upscale_delay_s=1,
                                         downscale_delay_s=10, rate_half_life_s=30)
    assert (config.tick_s, config.startup_s, config.backend) == (2, 60, "local")
    assert len(config.profile.windows) == 5
    monkeypatch.setenv("LLMQ_AUTOSCALE_TARGET_ONGOING", "2")
    assert autoscale_config(Settings.from_env()).policy.target_ongoing == 2
    monkeypatch.setenv("LLMQ_AUTOSCALE_MAX", "many")
    with pytest.raises(ValueError, match="LLMQ_AUTOSCALE_MAX must be an integer"):
        Settings.from_env()
