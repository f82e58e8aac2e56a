"""Data for the reference experiments: FashionMNIST and IMDB through tensorflow-datasets, with
offline fallbacks that ship inside installed packages."""

from __future__ import annotations

import dataclasses
import io
import queue
import re
import socket
import threading
import zlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import jax
import numpy as np

from jaxamp._src.errors import invalid_choice

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_IMDB_URL = "http://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
DATA_SOURCES = ("auto", "tfds", "embedded")


class DatasetUnavailable(RuntimeError):
    """The dataset cannot be obtained here (no network, nothing prepared)."""


@dataclasses.dataclass
class Dataset:
    """A classification dataset held in memory as NumPy arrays.

    Attributes:
      name: short name (``"fashion_mnist"``, ``"digits"``, ``"imdb_reviews"``...).
      source: where it came from, for reports.
      train_x: training inputs (float32 NHWC images, or int32 token ids).
      train_y: training labels, int32.
      test_x: test inputs.
      test_y: test labels.
      class_names: one name per class.
    """

    name: str
    source: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    class_names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def subset(self, train_examples: int | None, test_examples: int | None) -> Dataset:
        """The first ``train_examples``/``test_examples`` examples (all when ``None``)."""
        return dataclasses.replace(
            self,
            train_x=self.train_x[:train_examples],
            train_y=self.train_y[:train_examples],
            test_x=self.test_x[:test_examples],
            test_y=self.test_y[:test_examples],
        )


def reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to ``url``'s host opens within ``timeout`` seconds."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    result: list[bool] = []

    def connect() -> None:
        try:
            with socket.create_connection((parsed.hostname, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=connect, daemon=True)  # DNS itself may hang
    thread.start()
    thread.join(timeout + 1.0)
    return bool(result and result[0])


def fashion_mnist_builder(data_dir: str | None = None) -> Any:
    """tfds' FashionMNIST builder, encoding images with Pillow (TensorFlow not needed)."""
    import PIL.Image
    import tensorflow_datasets as tfds
    from tensorflow_datasets.image_classification import mnist

    with tfds.core.registered.skip_registration():

        class FashionMNIST(mnist.FashionMNIST):
            name = "fashion_mnist"

            def _generate_examples(
                self, num_examples: int, data_path: str, label_path: str
            ) -> Iterator[tuple[int, dict[str, Any]]]:
                images = mnist._extract_mnist_images(data_path, num_examples)
                labels = mnist._extract_mnist_labels(label_path, num_examples)
                for index, (image, label) in enumerate(zip(images, labels, strict=True)):
                    yield index, {"image": png_bytes(image, PIL.Image), "label": label}

    return FashionMNIST(data_dir=data_dir)


def png_bytes(image: np.ndarray, pil_image: Any = None) -> io.BytesIO:
    """A uint8 ``[H, W]`` or ``[H, W, 1]`` image as an in-memory PNG file."""
    if pil_image is None:
        import PIL.Image as pil_image
    buffer = io.BytesIO()
    pil_image.fromarray(np.asarray(image, np.uint8).squeeze(-1) if image.ndim == 3 else image).save(
        buffer, format="PNG"
    )
    buffer.seek(0)
    return buffer


def _read_split(source: Any, keys: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    records = [source[i] for i in range(len(source))]
    return (
        np.stack([r[keys[0]] for r in records]),
        np.asarray([r[keys[1]] for r in records], np.int32),
    )


def load_fashion_mnist(data_dir: str | None = None, download: bool = True) -> Dataset:
    """FashionMNIST through ``tfds.data_source``; images standardised, NHWC float32.

    Raises:
      DatasetUnavailable: when it is not prepared and cannot be downloaded.
    """
    import tensorflow_datasets as tfds

    builder = fashion_mnist_builder(data_dir)
    if not builder.is_prepared():
        if not download or not reachable(_FASHION_MNIST_URL):
            raise DatasetUnavailable("FashionMNIST is not prepared and its server is unreachable")
        builder.download_and_prepare(file_format="array_record")
    data_dir = str(builder.data_dir_root)
    sources = tfds.data_source(
        "fashion_mnist", split=["train", "test"], data_dir=data_dir, download=False
    )
    (train_x, train_y), (test_x, test_y) = (_read_split(s, ("image", "label")) for s in sources)
    train_x, test_x = standardize(train_x, test_x)
    return Dataset(
        "fashion_mnist",
        f"tensorflow-datasets fashion_mnist ({data_dir})",
        train_x,
        train_y,
        test_x,
        test_y,
        FASHION_MNIST_CLASSES,
    )


def standardize(train_x: np.ndarray, test_x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images to float32, zero mean and unit variance by the training set's statistics."""
    train = train_x.astype(np.float32) / 255.0
    test = test_x.astype(np.float32) / 255.0
    mean, std = float(train.mean()), float(train.std()) + 1e-6
    return (train - mean) / std, (test - mean) / std


def load_digits_28x28(seed: int = 0) -> Dataset:
    """scikit-learn's handwritten digits (real, shipped in the package), as 28x28x1 images.

    1,797 8x8 images of digits written by 43 people (UCI), scaled to 20x20 and
    centred in 28x28 as MNIST digits are; 80% train, 20% test.
    """
    import PIL.Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.zeros((len(digits.images), 28, 28, 1), np.uint8)
    for i, image in enumerate(digits.images):
        small = PIL.Image.fromarray((image * 255.0 / 16.0).astype(np.uint8))
        images[i, 4:24, 4:24, 0] = np.asarray(small.resize((20, 20), PIL.Image.Resampling.BILINEAR))
    order = np.random.default_rng(seed).permutation(len(images))
    images, labels = images[order], digits.target[order].astype(np.int32)
    split = int(0.8 * len(images))
    train_x, test_x = standardize(images[:split], images[split:])
    return Dataset(
        "digits",
        "scikit-learn digits (1,797 real 8x8 images, UCI), resized to 28x28",
        train_x,
        labels[:split],
        test_x,
        labels[split:],
        tuple(map(str, range(10))),
    )


class HashingTokenizer:
    """A word-level tokenizer that needs no vocabulary file: words are hashed into ids.

    Lower-cases, splits into words and punctuation, maps each to
    ``3 + crc32(word) % (vocab_size - 3)``, prepends ``[CLS]`` (1), appends
    ``[SEP]`` (2), truncates and pads with 0 to ``seq_len``.

    Examples:
      >>> tokens = HashingTokenizer(1000, 8)(["A great film."])
      >>> tokens.shape, int(tokens[0, 0]), int(tokens[0, 5]), int(tokens[0, 6])
      ((1, 8), 1, 2, 0)
    """

    def __init__(self, vocab_size: int = 30522, seq_len: int = 128):
        if vocab_size < 4 or seq_len < 2:
            raise ValueError(
                f"vocab_size must be >= 4 and seq_len >= 2, got {vocab_size}, {seq_len}."
            )
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def __call__(self, texts: list[str]) -> np.ndarray:
        ids = np.zeros((len(texts), self.seq_len), np.int32)
        for row, text in enumerate(texts):
            words = re.findall(r"\w+|[^\w\s]", text.lower())[: self.seq_len - 2]
            tokens = [1] + [3 + zlib.crc32(w.encode()) % (self.vocab_size - 3) for w in words]
            tokens.append(2)
            ids[row, : len(tokens)] = tokens
        return ids


def load_imdb(
    tokenizer: HashingTokenizer, data_dir: str | None = None, download: bool = True
) -> Dataset:
    """IMDB movie reviews (binary sentiment) through ``tfds.data_source``, tokenized."""
    import tensorflow_datasets as tfds

    builder = tfds.builder("imdb_reviews/plain_text", data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        if not download or not reachable(_IMDB_URL):
            raise DatasetUnavailable("IMDB is not prepared and its server is unreachable")
        builder.download_and_prepare(file_format="array_record")
    sources = tfds.data_source(
        "imdb_reviews/plain_text",
        split=["train", "test"],
        data_dir=str(builder.data_dir_root),
        download=False,
    )
    splits = []
    for source in sources:
        order = np.random.default_rng(0).permutation(len(source))  # interleave the classes
        records = [source[int(i)] for i in order]
        texts = [r["text"].decode() if isinstance(r["text"], bytes) else r["text"] for r in records]
        splits.append((tokenizer(texts), np.asarray([r["label"] for r in records], np.int32)))
    (train_x, train_y), (test_x, test_y) = splits
    return Dataset(
        "imdb_reviews",
        "tensorflow-datasets imdb_reviews/plain_text",
        train_x,
        train_y,
        test_x,
        test_y,
        ("negative", "positive"),
    )


_DOC_TOPICS = {  # pydoc_data topic -> class: four areas of the Python reference manual
    "numbers": (
        "integers",
        "floating",
        "imaginary",
        "numeric-types",
        "binary",
        "unary",
        "numbers",
        "power",
        "shifting",
        "bitwise",
        "booleans",
        "truth",
        "conversions",
        "comparisons",
    ),
    "statements": (
        "for",
        "while",
        "if",
        "try",
        "with",
        "assert",
        "return",
        "raise",
        "import",
        "del",
        "pass",
        "global",
        "nonlocal",
        "assignment",
        "augassign",
        "break",
        "continue",
        "compound",
    ),
    "classes": (
        "class",
        "customization",
        "attribute-access",
        "specialnames",
        "objects",
        "specialattrs",
        "function",
        "callable-types",
    ),
    "strings": ("strings", "formatstrings", "string-methods", "typesseq"),
}


def load_python_docs(tokenizer: HashingTokenizer, seed: int = 0) -> Dataset:
    """Sentences of the Python reference manual, classified by the manual's topic area.

    Real English text shipped with every Python (``pydoc_data.topics``): four
    classes (numbers, statements, classes, strings), 80% train, 20% test.
    """
    from pydoc_data.topics import topics

    texts, labels = [], []
    for label, names in enumerate(_DOC_TOPICS.values()):
        for name in names:
            for sentence in re.split(r"(?<=[.!?])\s+", topics.get(name, "")):
                if len(sentence.split()) >= 5:
                    texts.append(" ".join(sentence.split()))
                    labels.append(label)
    order = np.random.default_rng(seed).permutation(len(texts))
    ids = tokenizer([texts[i] for i in order])
    labels_arr = np.asarray(labels, np.int32)[order]
    split = int(0.8 * len(ids))
    return Dataset(
        "python_docs",
        "Python reference manual sentences (pydoc_data.topics), 4 topic classes",
        ids[:split],
        labels_arr[:split],
        ids[split:],
        labels_arr[split:],
        tuple(_DOC_TOPICS),
    )


def load_dataset(
    kind: str,
    source: str = "auto",
    data_dir: str | None = None,
    tokenizer: HashingTokenizer | None = None,
) -> tuple[Dataset, str | None]:
    """Images (``kind="images"``) or text (``kind="text"``) for the comparison.

    Args:
      kind: ``"images"`` (FashionMNIST) or ``"text"`` (IMDB).
      source: ``"tfds"`` (fail without the real dataset), ``"embedded"`` (use the
        offline fallback) or ``"auto"`` (try tfds, fall back).
      data_dir: tfds data directory.
      tokenizer: for text.

    Returns:
      The dataset and, when it fell back, a one-line explanation.

    Raises:
      ValueError: for an unknown ``kind`` or ``source``.
      DatasetUnavailable: with ``source="tfds"`` when the dataset cannot be had.
    """
    if source not in DATA_SOURCES:
        raise invalid_choice("data source", source, DATA_SOURCES)
    if kind not in ("images", "text"):
        raise invalid_choice("data kind", kind, ("images", "text"))
    tokenizer = tokenizer or HashingTokenizer()
    note = None
    if source in ("auto", "tfds"):
        try:
            if kind == "images":
                return load_fashion_mnist(data_dir), None
            return load_imdb(tokenizer, data_dir), None
        except DatasetUnavailable as e:
            if source == "tfds":
                raise
            note = f"{e}; using the embedded offline dataset instead."
    if kind == "images":
        return load_digits_28x28(), note
    return load_python_docs(tokenizer), note


def batches(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    seed: int,
    epoch: int,
    prefetch: int = 2,
    put: Any = None,
) -> Iterator[tuple[Any, Any]]:
    """Shuffled full batches for one epoch, prepared ``prefetch`` batches ahead.

    The order depends only on ``seed`` and ``epoch``, so every variant of a
    comparison sees the same batches in the same order. The last partial batch
    is dropped (one compiled step shape).

    Args:
      x: inputs.
      y: labels.
      batch_size: examples per batch.
      seed: shuffling seed.
      epoch: epoch number (mixed into the seed).
      prefetch: batches to prepare ahead in a background thread.
      put: function moving a batch to the device (``jax.device_put`` by default).

    Yields:
      ``(inputs, labels)`` device arrays.
    """
    if put is None:
        put = jax.device_put
    order = np.random.default_rng([seed, epoch]).permutation(len(x))
    starts = range(0, len(x) - batch_size + 1, batch_size)
    buffer: queue.Queue = queue.Queue(maxsize=max(1, prefetch))

    def produce() -> None:
        for start in starts:
            idx = order[start : start + batch_size]
            buffer.put(put((x[idx], y[idx])))
        buffer.put(None)

    threading.Thread(target=produce, daemon=True).start()
    while (item := buffer.get()) is not None:
        yield item
