"""deploy/: every Kubernetes manifest parses, and every metric that a query there (KEDA's trigger)
or in the Grafana dashboard names is one GET /metrics really exports; the dashboard shows every
metric of the contract (llmq/metrics.py).

The export is a real scrape: the web app (create_app) on a real Redis and a migrated SQLite database,
with a worker's heartbeat (the real recorder's and engine counters' figures) and an autoscaler's
decision in Redis, so every family has samples."""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmq import metrics as m
from llmq.engine.counters import EngineCounters
from llmq.events import WORKERS_KEY
from llmq.fleet import write_autoscaler
from llmq.settings import Settings
from tests.conftest import REPO, STORIES_DIR
from workers.request_metrics import RequestMetrics

DEPLOY = REPO / "deploy"
KUSTOMIZATION = DEPLOY / "kubernetes" / "kustomization.yaml"
MANIFESTS = sorted(set((DEPLOY / "kubernetes").glob("*.yaml")) - {KUSTOMIZATION})
DASHBOARD = DEPLOY / "grafana" / "llmq-dashboard.json"
METRIC_NAME = re.compile(r"llmq:[a-z0-9_:]+")  # e2e has a digit
QUERY_KEYS = {"query", "expr", "definition"}  # KEDA's trigger query; Grafana's targets and variables


def queries(document) -> list[str]:
    """Every string under a query key, anywhere in a parsed YAML or JSON document (other strings may
    name an image, `llmq:0.1.0`, which is no metric)."""
    found = []
    if isinstance(document, dict):
        for key, value in document.items():
            if key in QUERY_KEYS and isinstance(value, str):
                found.append(value)
            else:
                found += queries(value)
    elif isinstance(document, list):
        for item in document:
            found += queries(item)
    return found


def documents(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, redis_url, migrated_db) -> set[str]:
    """The sample names of one scrape of GET /metrics with every family present."""
    from app import create_app

    home = tmp_path_factory.mktemp("home")
    shutil.copy(migrated_db, home / "llmq.db")
    settings = Settings(home=home, database_url=f"sqlite:///{home / 'llmq.db'}", redis_url=redis_url,
                        model_path=str(STORIES_DIR), model_name="llama-3.2-1b")
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    recorder = RequestMetrics()
    recorder.arrived("r", 0.0)
    recorder.delta("r", 0, 1, "stop", 0.1)
    recorder.finished("r", 0.1)
    beat = {"model": "llama-3.2-1b", "at": time.time(), "running": 1, "waiting": 0, "free_blocks": 1,
            "total_blocks": 2, "metrics": {**EngineCounters().as_dict(), **recorder.snapshot()}}
    client.hset(WORKERS_KEY, "w1", json.dumps(beat))
    write_autoscaler(client, "llama-3.2-1b", {"desired": 1, "actual": 1, "min": 0, "max": 2, "backend": "keda"})
    flask_app = create_app(settings)
    try:
        response = flask_app.test_client().get("/metrics")
        assert response.status_code == 200
        return {sample.name for family in text_string_to_metric_families(response.get_data(as_text=True))
                for sample in family.samples}
    finally:
        flask_app.extensions["llmq"].db.engine.dispose()
        client.close()


def test_the_manifests_are_all_there_and_parse():
    kinds = {doc["kind"] for path in MANIFESTS for doc in documents(path)}
    assert {"Deployment", "Service", "Job", "ConfigMap", "Secret", "ScaledObject", "ScrapeConfig"} <= kinds
    for path in MANIFESTS:
        for doc in documents(path):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path.name
    (kustomization,) = documents(KUSTOMIZATION)
    assert set(kustomization["resources"]) == {p.name for p in MANIFESTS}  # `kubectl apply -k` applies them all


def test_the_worker_deployment_runs_celery_and_keda_scales_it():
    docs = {(doc["kind"], doc["metadata"]["name"]): doc for path in MANIFESTS for doc in documents(path)}
    worker = docs[("Deployment", "llmq-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert worker["command"] == ["celery", "-A", "workers.celery_app", "worker", "--loglevel", "INFO"]
    scaled = docs[("ScaledObject", "llmq-worker")]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "llmq-worker"
    assert 0 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    config = docs[("ConfigMap", "llmq")]["data"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == int(config["LLMQ_AUTOSCALE_UPSCALE_DELAY"])
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == int(config["LLMQ_AUTOSCALE_DOWNSCALE_DELAY"])
    assert scaled["cooldownPeriod"] == int(config["LLMQ_AUTOSCALE_DOWNSCALE_DELAY"])
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    assert m.QUEUE_DEPTH in trigger["metadata"]["query"]
    assert f'model_name="{config["MODEL_NAME"]}"' in trigger["metadata"]["query"]


def test_every_metric_the_manifests_and_the_dashboard_query_is_exported(exported):
    referenced = {path.name: {name for query in queries(doc) for name in METRIC_NAME.findall(query)}
                  for path, doc in [(p, d) for p in MANIFESTS for d in documents(p)] + [(DASHBOARD, json.loads(
                      DASHBOARD.read_text()))]}
    assert referenced["keda.yaml"] and referenced["llmq-dashboard.json"]  # the queries were found
    missing = {file: sorted(names - exported) for file, names in referenced.items() if names - exported}
    assert missing == {}


def test_the_dashboard_shows_every_metric_of_the_contract():
    dashboard = json.loads(DASHBOARD.read_text())
    named = {name for query in queries(dashboard) for name in METRIC_NAME.findall(query)}
    families = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in named}
    contract = {value for key, value in vars(m).items() if key.isupper() and isinstance(value, str)
                and value.startswith(m.PREFIX) and value != m.PREFIX}
    assert contract - families == set()
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_exported_names_are_what_the_checks_above_rely_on(exported):
    # Guards the two tests above: histograms come with their suffixes, counters with _total.
    assert {"llmq:time_to_first_token_seconds_bucket", "llmq:request_success_total", "llmq:queue_depth",
            "llmq:autoscaler_desired_workers", "llmq:batch_lines_done_total"} <= exported
    assert "llmq:nonexistent" not in exported
