"""The dashboard in a real headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium), against the whole service: a Redis server, a Celery worker process, the web server, two
tenants with API keys. As a person would: log in (a bad key first), upload a batch (a file with a
bad line first), watch its progress bar reach 100 %, download its output, look at the workers,
stream a prompt in the playground and cancel another, and never see the other tenant's batch.

Screenshots of each page go to $LLMQ_SCREENSHOTS (default: the test's temporary folder), with
page-weight.json (the bytes each first load transferred). Without Chromium, the test skips, saying
what to install.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from stack.local import LocalStack
from tests.service.conftest import MODEL_NAME, wait_until

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="no headless Chromium here: apt-get install chromium chromium-driver (.ci/run does)")]

LINES = 12


def request_line(custom_id: str, prompt: str, max_tokens: int = 24) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}})


@pytest.fixture(scope="module")
def tenants(served_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("dashboard-home")
    env = {"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}", "MODEL_PATH": str(served_model_dir),
           "MODEL_NAME": MODEL_NAME, "LLMQ_MAX_NUM_SEQS": "8", "LLMQ_HEARTBEAT_SECONDS": "1"}
    with LocalStack(env, start_redis=True, log_dir=home) as stack:
        yield stack, stack.key_headers("acme", "globex")


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("LLMQ_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def downloads(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def browser(downloads):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1360,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(flag)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    try:
        driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    except WebDriverException as err:
        pytest.skip(f"Chromium did not start: {err.msg}")
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


class Person:
    """What a person does and sees, in the browser, with a screenshot of each page looked at."""

    def __init__(self, browser, base_url: str, shots: Path):
        self.browser, self.base_url, self.shots = browser, base_url, shots
        self.weights: dict[str, int] = {}

    def open(self, path: str) -> None:
        self.browser.get(self.base_url + path)

    def find(self, css: str):
        return self.browser.find_element(By.CSS_SELECTOR, css)

    def finds(self, css: str):
        return self.browser.find_elements(By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        """The element's text, found again where the page replaced it between the lookup and the read: the
        pages' live parts (charts, tables) re-render on their own."""
        for _ in range(10):
            try:
                return self.find(css).text
            except StaleElementReferenceException:
                time.sleep(0.05)
        return self.find(css).text

    def sees(self, css: str, timeout: float = 120.0):
        return wait_until(lambda: self.finds(css), timeout=timeout)[0]

    def screenshot(self, name: str) -> Path:
        path = self.shots / f"dashboard-{name}.png"
        self.browser.save_screenshot(str(path))
        return path

    def note_weight(self, name: str) -> int:
        """The bytes a first load of this page transfers (the cache emptied, the page loaded again):
        the document and everything it fetched, headers included."""
        self.browser.execute_cdp_cmd("Network.clearBrowserCache", {})
        self.browser.refresh()
        total = self.browser.execute_script(
            "const nav = performance.getEntriesByType('navigation')[0];"
            "return nav.transferSize + performance.getEntriesByType('resource')"
            ".reduce((sum, r) => sum + r.transferSize, 0);")
        self.weights[name] = total
        return total


def test_a_person_runs_a_batch_and_the_playground_in_the_browser(tenants, browser, shots, downloads):
    stack, keys = tenants
    started = time.monotonic()
    api = httpx.Client(base_url=stack.base_url, timeout=60)
    acme_key, globex_key = (keys[t]["Authorization"].split()[1] for t in ("acme", "globex"))
    # The other tenant's batch, made through the API: it must never show up for acme.
    globex_file = api.post("/v1/files", headers=keys["globex"], data={"purpose": "batch"}, files={
        "file": ("theirs.jsonl", io.BytesIO((request_line("g0", "Their secret") + "\n").encode()))}).json()["id"]
    theirs = api.post("/v1/batches", headers=keys["globex"], json={
        "input_file_id": globex_file, "endpoint": "/v1/completions", "completion_window": "24h"}).json()["id"]
    person = Person(browser, stack.base_url, shots)

    # A page leads to the log-in; a wrong key is told why, the right one goes on.
    person.open("/dashboard/batches")
    assert "/dashboard/login" in browser.current_url
    person.find("#api-key").send_keys("llmq-" + "0" * 43)
    person.find("#login-button").click()
    assert "Incorrect API key provided" in person.sees("#login-error").text
    person.screenshot("login-error")
    person.find("#api-key").send_keys(acme_key)
    person.find("#login-button").click()
    person.sees("#upload-form")
    assert "acme" in person.text("#tenant")
    person.note_weight("batches")

    # A file with a bad line is refused, saying which line and why.
    bad_file = downloads.parent / "with-a-bad-line.jsonl"
    bad_file.write_text(request_line("a", "Once") + "\n{this is not json\n")
    person.find("#upload-file").send_keys(str(bad_file))
    person.find("#upload-button").click()
    problem = person.sees("#upload-error").text
    assert "line 2" in problem and "not valid JSON" in problem
    person.screenshot("upload-error")

    # The good file: the batch page's progress bar climbs to 100 % by itself.
    good_file = downloads.parent / "prompts.jsonl"
    prompts = {f"q{i}": f"Once upon a time {i}" for i in range(LINES)}
    good_file.write_text("".join(request_line(cid, prompt) + "\n" for cid, prompt in prompts.items()))
    person.find("#upload-file").send_keys(str(good_file))
    person.find("#upload-button").click()
    person.sees("#batch-status")
    batch_id = browser.current_url.rsplit("/", 1)[1]
    seen_percents = set()

    def finished() -> bool:
        seen_percents.add(int(person.find("[role=progressbar]").get_attribute("aria-valuenow")))
        return person.text("#batch-status") == "completed"

    wait_until(finished, timeout=300, interval=0.5)
    assert max(seen_percents) == 100 and person.text("#count-completed") == str(LINES)
    person.note_weight("batch")
    person.screenshot("batch")

    # The output file downloads, a line for every custom_id.
    person.find("#download-output").click()
    output = wait_until(lambda: [p for p in downloads.glob("*.jsonl") if p.stat().st_size], timeout=30)[0]
    lines = [json.loads(text) for text in output.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(prompts)
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert len(person.finds("table.lines tr[data-status=completed]")) == LINES

    # The batches page: ours, never theirs.
    person.open("/dashboard/batches")
    rows = [row.get_attribute("data-batch") for row in person.finds("table.batches tr[data-batch]")]
    assert batch_id in rows and theirs not in rows
    person.screenshot("batches")
    person.open(f"/dashboard/batches/{theirs}")
    assert "No batch found" in person.sees("#error-message").text

    # The workers page: the worker, its state and its cache.
    person.open("/dashboard/workers")
    person.sees("tr[data-worker]")
    assert "ready" in person.text("tr[data-worker]") and person.finds("tr[data-worker] .bar.kv")
    wait_until(lambda: " 0 samples" not in person.text("figure.chart figcaption"), timeout=60)  # the worker's history
    person.note_weight("workers")
    person.screenshot("workers")

    # The playground streams a completion: the greedy text the API gives for the same prompt.
    person.open("/dashboard/playground")
    person.note_weight("playground")
    prompt = person.find("#prompt")
    prompt.clear()
    prompt.send_keys("The little dog")
    max_tokens = person.find("#max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("40")
    person.find("#generate").click()
    wait_until(lambda: person.text("#playground-status").startswith("finished"), timeout=120)
    streamed = person.find("#output").get_attribute("textContent")
    person.screenshot("playground")
    expected = api.post("/v1/completions", headers=keys["acme"], json={
        "model": MODEL_NAME, "prompt": "The little dog", "max_tokens": 40, "temperature": 0}).json()
    assert streamed == expected["choices"][0]["text"] and streamed

    # Another, long one, cancelled while it streams: it stops, and says so.
    max_tokens.clear()
    max_tokens.send_keys("480")
    person.find("#ignore-eos").click()
    person.find("#generate").click()
    wait_until(lambda: len(person.find("#output").get_attribute("textContent")) > 10, timeout=120)
    request_id = person.text("#playground-status").split()[-1]
    person.find("#cancel").click()
    wait_until(lambda: person.text("#playground-status").startswith("cancelled"), timeout=60)
    person.screenshot("playground-cancelled")
    row = wait_until(lambda: (r := api.get(f"/v1/requests/{request_id}", headers=keys["acme"]).json())["status"]
                     in ("cancelled", "completed", "failed") and r, timeout=60)
    assert row["status"] == "cancelled" and row["usage"]["completion_tokens"] < 480

    (shots / "page-weight.json").write_text(json.dumps(person.weights, indent=2))
    print(f"\nbrowser test: {time.monotonic() - started:.1f} s; screenshots in {shots}; "
          f"first-load bytes: {person.weights}")
