"""The autoscaler's library: its policy (a pure function of what the fleet shows), the traffic
profile that keeps workers warm by hour of the week, and the replay that runs an arrival trace
through the policy in simulated time. No Celery, no Flask, no torch: the process that acts on the
decisions, and its worker backends, live in stack/ (stack/autoscaler.py)."""
