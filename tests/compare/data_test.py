"""Tests for jaxamp/_src/compare/data.py: the real tfds code paths, offline, and the fallbacks."""

import numpy as np
import pytest

from jaxamp._src.compare import data

tfds = pytest.importorskip("tensorflow_datasets")


def _fake_fashion_mnist(data_dir, train=64, test=32):
    """The real FashionMNIST builder (jaxamp's Pillow-encoding subclass), fed generated images."""
    builder_cls = type(data.fashion_mnist_builder(str(data_dir)))

    with tfds.core.registered.skip_registration():

        class Generated(builder_cls):
            name = "fashion_mnist"

            def _split_generators(self, dl_manager):
                return [
                    tfds.core.SplitGenerator(name=split, gen_kwargs={"n": n, "seed": seed})
                    for seed, (split, n) in enumerate([("train", train), ("test", test)])
                ]

            def _generate_examples(self, n, seed):
                rng = np.random.default_rng(seed)
                for i in range(n):
                    label = i % 10
                    image = rng.integers(0, 40, (28, 28), dtype=np.uint8)
                    image[2 * label : 2 * label + 4] = 220  # a class-dependent stripe
                    yield i, {"image": data.png_bytes(image), "label": label}

    Generated(data_dir=str(data_dir)).download_and_prepare(file_format="array_record")


def test_fashion_mnist_through_tfds_data_source(tmp_path):
    _fake_fashion_mnist(tmp_path)
    dataset = data.load_fashion_mnist(str(tmp_path), download=False)
    assert dataset.name == "fashion_mnist" and dataset.num_classes == 10
    assert dataset.train_x.shape == (64, 28, 28, 1) and dataset.test_x.shape == (32, 28, 28, 1)
    assert dataset.train_x.dtype == np.float32 and dataset.train_y.dtype == np.int32
    assert abs(float(dataset.train_x.mean())) < 1e-4
    assert abs(float(dataset.train_x.std()) - 1) < 1e-3
    assert sorted(set(dataset.train_y.tolist())) == list(range(10))
    # the stripe of each label survived PNG encoding and decoding
    label = int(dataset.train_y[0])
    raw = dataset.train_x[0, :, :, 0]
    assert raw[2 * label + 1].mean() > raw.mean() + 1.0
    # load_dataset takes the tfds path when the data is there
    loaded, note = data.load_dataset("images", "tfds", str(tmp_path))
    assert note is None and loaded.name == "fashion_mnist"


def test_unprepared_and_unreachable_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "reachable", lambda url, timeout=3.0: False)
    with pytest.raises(data.DatasetUnavailable):
        data.load_fashion_mnist(str(tmp_path))
    with pytest.raises(data.DatasetUnavailable):
        data.load_dataset("images", "tfds", str(tmp_path))
    dataset, note = data.load_dataset("images", "auto", str(tmp_path))
    assert dataset.name == "digits" and "embedded" in note
    assert dataset.train_x.shape[1:] == (28, 28, 1) and dataset.num_classes == 10
    text, note = data.load_dataset("text", "auto", str(tmp_path), data.HashingTokenizer(1000, 32))
    assert text.name == "python_docs" and "embedded" in note
    assert text.train_x.shape[1] == 32 and text.train_x.dtype == np.int32


def test_imdb_through_tfds_data_source(tmp_path):
    import tensorflow_datasets.datasets.imdb_reviews.imdb_reviews_dataset_builder as imdb
    from etils import epath

    with tfds.core.registered.skip_registration():

        class Generated(imdb.Builder):
            name = "imdb_reviews"
            pkg_dir_path = epath.Path(imdb.__file__).parent

            def _split_generators(self, dl_manager):
                return [
                    tfds.core.SplitGenerator(name=s, gen_kwargs={"n": n})
                    for s, n in [("train", 20), ("test", 10)]
                ]

            def _generate_examples(self, n):
                for i in range(n):
                    yield (
                        i,
                        {
                            "text": "a great movie!" if i % 2 else "a dull, bad film.",
                            "label": i % 2,
                        },
                    )

    Generated(data_dir=str(tmp_path), config="plain_text").download_and_prepare(
        file_format="array_record"
    )
    dataset = data.load_imdb(data.HashingTokenizer(1000, 16), str(tmp_path), download=False)
    assert dataset.train_x.shape == (20, 16) and dataset.test_x.shape == (10, 16)
    assert dataset.class_names == ("negative", "positive")
    assert (dataset.train_x[:, 0] == 1).all()  # [CLS]
    positives = dataset.train_x[dataset.train_y == 1]
    assert (positives == positives[0]).all()  # same text, same ids


def test_hashing_tokenizer():
    tokens = data.HashingTokenizer(100, 6)(["Hello, world!", "a b c d e f g h"])
    assert tokens.shape == (2, 6) and tokens.dtype == np.int32
    assert tokens[0].tolist()[:1] == [1] and tokens[0, 5] == 2 and tokens[0, 4] > 2
    assert tokens[1, -1] == 2 and (tokens[1] > 0).all()  # truncated to fit [CLS] ... [SEP]
    assert (tokens[tokens > 2] < 100).all()
    with pytest.raises(ValueError, match="vocab_size"):
        data.HashingTokenizer(2, 8)


def test_batches_are_deterministic_and_shuffled():
    x = np.arange(10, dtype=np.float32)[:, None]
    y = np.arange(10, dtype=np.int32)
    first = [np.asarray(b[1]) for b in data.batches(x, y, 3, seed=0, epoch=0)]
    again = [np.asarray(b[1]) for b in data.batches(x, y, 3, seed=0, epoch=0)]
    other = [np.asarray(b[1]) for b in data.batches(x, y, 3, seed=0, epoch=1)]
    assert len(first) == 3 and all(len(b) == 3 for b in first)  # the partial batch is dropped
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    assert not all((a == b).all() for a, b in zip(first, other, strict=True))
    assert len(set(np.concatenate(first).tolist())) == 9


def test_bad_arguments():
    with pytest.raises(ValueError, match="Valid choices: auto, tfds, embedded"):
        data.load_dataset("images", "internet")
    with pytest.raises(ValueError, match="Valid choices: images, text"):
        data.load_dataset("audio")


def test_digits_and_docs_are_real_and_split():
    digits = data.load_digits_28x28()
    assert len(digits.train_x) + len(digits.test_x) == 1797
    docs = data.load_python_docs(data.HashingTokenizer(1000, 24))
    assert docs.num_classes == 4 and len(docs.train_x) > 1000
    assert set(docs.test_y.tolist()) == {0, 1, 2, 3}
