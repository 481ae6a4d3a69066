"""InputCodec: what a version's requests may bring besides tensors (encoded images, UTF-8 texts) and its labels."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from layerserve.errors import ModelLoadError, UnsupportedMediaTypeError
from layerserve.features.images import ImageDecoder, ImageSpec
from layerserve.features.labels import load_labels
from layerserve.lifecycle.model import Signature
from layerserve.serving.layers import LayerGraph
from layerserve.settings import ModelConfig
from layerserve.tensors import Array
from layerserve.training.recipe import LABELS_FILE
from layerserve.training.tokenizer import Tokenizer


@dataclass(frozen=True)
class InputCodec:
    """A version's image input (config `input: image`), tokenizer (`input: text`), labels and classify output,
    read from its config.yaml and folder and checked against its signature."""

    model: str
    signature: Signature
    classify_output: str
    image: ImageSpec | None = None
    tokenizer: Tokenizer | None = None
    labels: list[str] | None = None
    config_digest: str = ""

    @classmethod
    def read(cls, model: str, config: ModelConfig, graph: LayerGraph, folder: Path) -> InputCodec:
        """The codec of the version in `folder`.

        Raises:
            BadRequestError: `classify_output` names no tensor of the graph.
            ModelLoadError: a text model without an INT32 [-1, sequence_length] input, a bad labels file.
        """
        signature = graph.signature
        if config.classify_output is not None:
            graph.spec(config.classify_output, "output")
        image = ImageSpec.for_input(signature.inputs[0], config) if config.input == "image" else None
        tokenizer = None
        if config.input == "text":
            tokenizer = Tokenizer.load(folder)
            expected = (-1, tokenizer.sequence_length)
            first = signature.inputs[0]
            if first.datatype != "INT32" or first.shape != expected:
                found = f"{first.datatype} {list(first.shape)}"
                raise ModelLoadError(f"input: text needs an INT32 {list(expected)} input, '{first.name}' is {found}")
        own_labels = folder / LABELS_FILE  # a version's own labels (written by training) win
        labels = load_labels(folder, LABELS_FILE) if own_labels.is_file() else load_labels(folder.parent, config.labels)
        return cls(
            model, signature, config.classify_output or signature.outputs[0].name, image, tokenizer, labels,
            hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:16],
        )  # fmt: skip

    @property
    def encoded_input(self) -> str | None:
        """The input that may come encoded, as BYTES: images for image models, UTF-8 texts for text models."""
        if self.image is None and self.tokenizer is None:
            return None
        return self.signature.inputs[0].name

    def encode_texts(self, texts: list[str]) -> dict[str, Array]:
        """Texts -> the model's token-id input.

        Raises:
            UnsupportedMediaTypeError: the model does not take texts.
        """
        if self.tokenizer is None:
            raise UnsupportedMediaTypeError(
                f"model '{self.model}' does not take texts (its config.yaml has no 'input: text')"
            )
        return {self.signature.inputs[0].name: self.tokenizer.encode(texts)}

    async def decode_encoded(self, inputs: dict[str, Array], decoder: ImageDecoder) -> dict[str, Array]:
        """Replace a BYTES input of encoded images or UTF-8 texts with the model's tensor."""
        name = self.encoded_input
        if name is None or name not in inputs or inputs[name].dtype != object:
            return inputs
        if self.tokenizer is not None:
            texts = [bytes(item).decode("utf-8", "replace") for item in inputs[name].reshape(-1)]
            return {**inputs, **self.encode_texts(texts)}
        return await decoder.decode_inputs(inputs, self.image)

    def require_image(self) -> ImageSpec:
        """The image spec of an image model.

        Raises:
            UnsupportedMediaTypeError: the model does not take images.
        """
        if self.image is None and self.tokenizer is None:
            raise UnsupportedMediaTypeError(
                f"model '{self.model}' does not take images or texts (its config.yaml has neither input: image nor "
                f"input: text): send tensors to /v2/models/{self.model}/infer"
            )
        if self.image is None:
            raise UnsupportedMediaTypeError(
                f"model '{self.model}' does not take images (its config has no input: image)"
            )
        return self.image
