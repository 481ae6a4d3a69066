"""Text in: a tokenizer that layerserve owns (outside the Keras graph, so every engine runs the model)."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Literal

import numpy as np

from layerserve.errors import ModelLoadError
from layerserve.tensors import Array

TOKENIZER_FILE = "tokenizer.json"
PAD, UNKNOWN = 0, 1
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)


@dataclass
class Tokenizer:
    """Splits text into tokens (`whitespace`: words and punctuation, lower-cased; `character`: each
    non-space character, for Chinese), adds n-grams up to `ngrams`, and maps the `max_tokens` most
    frequent to ids; sequences are padded or cut to `sequence_length`."""

    split: Literal["whitespace", "character"] = "whitespace"
    ngrams: int = 1
    max_tokens: int = 20000
    sequence_length: int = 128
    vocabulary: list[str] = field(default_factory=list)
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def tokens(self, text: str) -> list[str]:
        """The tokens of one text, n-grams included."""
        if self.split == "character":  # n-grams are slices of the text without its spaces (str.split's, isspace's)
            joined = "".join(text.split())
            grams = list(joined)
            for n in range(2, self.ngrams + 1):
                grams += [joined[i : i + n] for i in range(len(joined) - n + 1)]
            return grams
        units = _WORD.findall(text.lower())
        grams = list(units)
        for n in range(2, self.ngrams + 1):
            grams += [" ".join(units[i : i + n]) for i in range(len(units) - n + 1)]
        return grams

    def fit(self, texts: list[str]) -> Tokenizer:
        """Learn the vocabulary: the most frequent tokens (ids 0 and 1 are padding and unknown)."""
        counts = Counter(token for text in texts for token in set(self.tokens(text)))
        self.vocabulary = [token for token, _ in counts.most_common(self.max_tokens - 2)]
        self._index = {}
        return self

    @property
    def size(self) -> int:
        """The number of ids, padding and unknown included."""
        return len(self.vocabulary) + 2

    def encode(self, texts: list[str]) -> Array:
        """int32 ids, shape (len(texts), sequence_length), 0-padded at the end."""
        if not self._index and self.vocabulary:  # built once: the vocabulary is large
            self._index = {token: i + 2 for i, token in enumerate(self.vocabulary)}
        find, length = self._index.get, self.sequence_length
        ids = np.zeros((len(texts), length), np.int32)
        for row, text in enumerate(texts):
            encoded = list(map(find, self.tokens(text)[:length], repeat(UNKNOWN)))
            ids[row, : len(encoded)] = encoded
        return ids

    def save(self, folder: Path) -> None:
        """Write `tokenizer.json` into a version folder."""
        data = {key: value for key, value in asdict(self).items() if not key.startswith("_")}
        (folder / TOKENIZER_FILE).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> Tokenizer:
        """Read a version folder's `tokenizer.json`.

        Raises:
            ModelLoadError: the file is missing or not a tokenizer.
        """
        try:
            data = json.loads((folder / TOKENIZER_FILE).read_text(encoding="utf-8"))
            return cls(**data)
        except (OSError, ValueError, TypeError) as error:
            raise ModelLoadError(f"{TOKENIZER_FILE}: {error}") from error
