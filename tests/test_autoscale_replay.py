"""The replay (llmq/autoscale/replay.py): a trace through the policy against the simulated fleet,
exactly, tick by tick; the traces it reads (llmq/autoscale/trace.py); and the picture it draws."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from llmq.autoscale.config import PolicyConfig
from llmq.autoscale.plot import plot_replay
from llmq.autoscale.profile import parse_profile
from llmq.autoscale.replay import FleetModel, Sample, SimulatedFleet, replay
from llmq.autoscale.trace import SYNTHETIC_BATCH, Trace, read_trace, synthetic_trace, trace_of_times

REPO = Path(__file__).resolve().parents[1]
CONFIG = PolicyConfig(min_workers=1, max_workers=3, target_ongoing=4, upscale_delay_s=1, downscale_delay_s=10,
                      rate_half_life_s=1)
# One worker holds 4 requests and finishes 1 a second when full: a request takes 4 s.
FLEET = FleetModel(startup_s=2, throughput=1, slots=4)


def test_a_simulated_worker_serves_once_ready_and_in_proportion_to_its_slots():
    fleet = SimulatedFleet(FLEET, ready_at=[0.0], demand=10)
    assert (fleet.in_flight(0), fleet.serve(0, 2)) == (4, 2)
    fleet.scale_to(2, now=2)
    assert fleet.ready_at == [0.0, 4.0] and fleet.ready(3) == 1 and fleet.in_flight(4) == 8
    fleet.demand = 2
    # 2 in flight finish half a request a second; then the one left a quarter.
    assert [fleet.serve(4, 1) for _ in range(6)] == [0, 1, 0, 0, 0, 1]


def test_scaling_down_stops_a_starting_worker_first_then_the_newest():
    fleet = SimulatedFleet(FLEET, ready_at=[0.0, 1.0, 9.0])
    fleet.scale_to(2, now=5)
    assert fleet.ready_at == [0.0, 1.0]
    fleet.scale_to(1, now=5)
    assert fleet.ready_at == [0.0]


def test_a_burst_scales_up_after_the_delay_and_back_down_after_the_downscale_delay():
    result = replay(Trace((0.5,) * 16), CONFIG, FLEET, tick_s=1)
    assert result.samples[:4] == (
        Sample(1, 16, 12, 4, workers=1, ready=1, desired=1),  # seen; the decision to scale up is pending
        Sample(2, 0, 11, 4, workers=3, ready=1, desired=3),  # held for the 1 s delay: two workers started
        Sample(3, 0, 10, 4, workers=3, ready=1, desired=3),
        Sample(4, 0, 1, 12, workers=3, ready=3, desired=3),  # ready after their 2 s start-up
    )
    workers = [s.workers for s in result.samples]
    # At 6 s the 8 requests left ask for 2 workers: that holds 10 s; then nothing asks for 1, 10 s more.
    assert workers.index(2) + 1 == 16 and workers.index(1, 2) + 1 == 27
    assert result.samples[-1] == Sample(27, 0, 0, 0, workers=1, ready=1, desired=1)
    assert result.arrivals == 16 and result.peak_workers == 3
    assert result.worker_seconds == sum(workers)


def test_nothing_is_lost_and_the_replay_ends_at_the_floor():
    trace = synthetic_trace(seed=1)
    config = PolicyConfig(min_workers=0, max_workers=6, target_ongoing=16, upscale_delay_s=30, downscale_delay_s=600)
    result = replay(trace, config, FleetModel(startup_s=60, throughput=0.5, slots=16), tick_s=5)
    assert result.arrivals == len(trace.times)
    last = result.samples[-1]
    assert (last.queued, last.in_flight, last.workers) == (0, 0, 0)
    assert result.peak_workers == 6 and all(s.workers <= 6 for s in result.samples)


def test_min_zero_starts_a_worker_when_a_request_arrives():
    config = PolicyConfig(min_workers=0, max_workers=2, target_ongoing=4, upscale_delay_s=30, downscale_delay_s=5)
    result = replay(Trace((10.0,)), config, FLEET, tick_s=1)
    at = {s.t: s for s in result.samples}
    assert [at[t].workers for t in range(1, 13)] == [0] * 9 + [1, 1, 1]  # at once: no worker serves it
    assert at[11].ready == 0 and at[12].ready == 1  # 2 s to start
    assert result.samples[-1].workers == 0


def test_the_profile_pre_warms_workers_a_start_up_ahead_of_its_window():
    monday_7 = datetime(2024, 1, 1, 7, 0).timestamp()  # the profile reads local time, as the trace's start
    config = PolicyConfig(min_workers=0, max_workers=4, target_ongoing=4, upscale_delay_s=1, downscale_delay_s=60)
    fleet = FleetModel(startup_s=120, throughput=1, slots=4)
    trace = Trace((3600.0 + 30,), start=monday_7)  # one request at 08:00:30
    result = replay(trace, config, fleet, tick_s=10, profile=parse_profile("mon 08-09=3"))
    at = {s.t: s for s in result.samples}
    assert at[3470].workers == 0 and at[3480].workers == 3  # started at 07:58, two minutes ahead
    assert at[3590].ready == 0 and at[3600].ready == 3  # ready at 08:00
    assert at[3600 + 3600].workers == 3  # kept until the window ends, then the downscale delay
    assert at[7200 + 60].workers == 0


def test_the_synthetic_trace_is_the_same_for_the_same_seed():
    one, again, other = synthetic_trace(0), synthetic_trace(0), synthetic_trace(1)
    assert one == again and one != other
    assert one.times.count(float(SYNTHETIC_BATCH[0])) >= SYNTHETIC_BATCH[1]
    assert one.start == datetime(2024, 1, 1, 7).timestamp()


def test_a_trace_file_with_a_header_comments_and_counts(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("time,count\n# a comment\n10.5\n12,3\n\n11\n")
    trace = read_trace(path)
    assert trace.times == (0.0, 0.5, 1.5, 1.5, 1.5) and trace.start is None and trace.name == "trace.csv"


def test_a_trace_of_unix_times_keeps_its_clock():
    trace = trace_of_times([1_700_000_100.0, 1_700_000_000.0])
    assert trace.times == (0.0, 100.0) and trace.start == 1_700_000_000.0


@pytest.mark.parametrize(("content", "message"), [
    ("1\nsoon\n", r"trace.csv:2: expected time\[,count\]"),
    ("1\n2,many\n", r"trace.csv:2: expected time\[,count\]"),
    ("1\ninf\n", "trace.csv:2: the time must be a finite number"),
    ("1,-2\n", "trace.csv:1: the time must be a finite number and the count 0 or more"),
    ("time\n", "no arrivals in the file"),
])
def test_a_bad_trace_file_names_its_line(tmp_path, content, message):
    path = tmp_path / "trace.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_trace(path)


def test_the_plot_is_a_png(tmp_path):
    result = replay(Trace((0.5,) * 16), CONFIG, FLEET, tick_s=1)
    path = plot_replay(result, tmp_path / "fleet.png", title="a burst")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert "16 arrivals over 27 s: peak 3 workers" in result.summary()


# ---- the command line ---------------------------------------------------------------------------

def _llmq(*args, env=None):
    return subprocess.run([sys.executable, "-m", "stack.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_llmq_autoscale_replays_a_trace_file_and_plots_it(tmp_path):
    trace = tmp_path / "burst.csv"
    trace.write_text("time,count\n0,16\n")
    done = _llmq("autoscale", "--replay", str(trace), "--plot", str(tmp_path / "fleet.png"), "--startup", "2",
                 "--throughput", "1", "--min-workers", "1", "--max-workers", "3", "--upscale-delay", "1",
                 "--downscale-delay", "10", env={"LLMQ_HOME": str(tmp_path), "LLMQ_MAX_NUM_SEQS": "4",
                                                 "LLMQ_AUTOSCALE_TICK_SECONDS": "1"})
    assert done.returncode == 0, done.stderr
    assert "replay of burst.csv" in done.stdout and "16 arrivals over 27 s: peak 3 workers" in done.stdout
    assert (tmp_path / "fleet.png").read_bytes()[:4] == b"\x89PNG"


def test_llmq_autoscale_refuses_a_bad_setting_before_it_starts_anything(tmp_path):
    done = _llmq("autoscale", env={"LLMQ_HOME": str(tmp_path), "LLMQ_AUTOSCALE_MIN": "2", "LLMQ_AUTOSCALE_MAX": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "LLMQ_AUTOSCALE_MAX is 1: it must be at least 1 and at least LLMQ_AUTOSCALE_MIN (2)" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no Redis, no model made
    bad = _llmq("autoscale", env={"LLMQ_HOME": str(tmp_path), "LLMQ_AUTOSCALE_PROFILE": "weekdays 9-5=2"})
    assert bad.returncode == 2 and "'weekdays' is not a day" in bad.stderr
