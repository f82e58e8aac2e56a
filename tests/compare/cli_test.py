"""Tests for jaxamp/_src/compare/cli.py: flags, errors and the files ``--out`` writes."""

import json
import subprocess
import sys

import pytest

from jaxamp._src.compare.cli import build_parser, main
from tests.helpers.promotion import OPTAX


def parse(*args):
    return build_parser().parse_args(["compare", *args])


def test_flags():
    args = parse(
        "--model",
        "bert",
        "--variants",
        "fp32, BF16",
        "--train-examples",
        "all",
        "--epochs",
        "3",
        "--layers",
        "2",
    )
    assert args.model == "bert" and args.variants == ("fp32", "bf16")
    assert args.train_examples is None and args.epochs == 3 and args.layers == 2
    assert parse("--variants", "fp32,bf16,fp8,FP8-delayed").variants == (
        "fp32",
        "bf16",
        "fp8",
        "fp8-delayed",
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--variants", "fp32,fp4"],
            "unknown variant(s) fp4. Valid choices: fp32, tf32, bf16, fp16,",
        ),
        (["--epochs", "0"], "must be a positive integer, got 0"),
        (["--model", "vgg"], "invalid choice: 'vgg'"),
        (["--data", "web"], "invalid choice: 'web'"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_config_errors_exit_2(capsys):
    assert main(["compare", "--model", "bert", "--hidden", "100", "--heads", "12"]) == 2
    assert "divisible" in capsys.readouterr().err


@pytest.mark.standard_promotion(OPTAX)
def test_compare_writes_report_and_plots(tmp_path, capsys):
    out = tmp_path / "report"
    code = main(
        [
            "compare",
            "--model",
            "bert",
            "--layers",
            "1",
            "--hidden",
            "32",
            "--heads",
            "2",
            "--seq-len",
            "16",
            "--vocab-size",
            "256",
            "--batch-size",
            "16",
            "--train-examples",
            "48",
            "--test-examples",
            "32",
            "--epochs",
            "1",
            "--variants",
            "fp32,fp16",
            "--data",
            "embedded",
            "--no-numerics",  # the numerics checks' report has its own tests (app_test.py)
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "variant" in printed and "fp16" in printed and "speed-up" in printed
    report = json.loads((out / "report.json").read_text())
    assert [r["variant"] for r in report["runs"]] == ["fp32", "fp16"]
    assert all(r.get("divergence") is None for r in report["runs"])  # --no-numerics
    assert "environment" in report and "jax" in report["environment"]
    assert "| variant |" in (out / "report.md").read_text()
    for name in ("loss.png", "loss_scale.png", "underflow.png", "time.png", "accuracy.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_python_dash_m_and_help():
    result = subprocess.run(
        [sys.executable, "-m", "jaxamp", "compare", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "--variants" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "jaxamp"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "compare" in result.stderr


def test_help_says_what_the_cpu_defaults_are(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fp32 and bf16 on a CPU" in text
    assert "ResNet18 of width 32 on a CPU without bf16 units" in text
    assert "bf16 and fp16 on a CPU" not in text


def _no_run(monkeypatch):
    from jaxamp._src.compare import cli

    def fail(*args, **kwargs):
        raise AssertionError("the comparison ran before the options were checked")

    monkeypatch.setattr(cli, "compare", fail)


def test_an_unwritable_out_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    blocker = tmp_path / "a file"
    blocker.write_text("")
    for out in (blocker / "report", "/proc/jaxamp-report"):
        assert main(["compare", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out '{out}' cannot be written" in err, err
    assert main(["compare", "--out", ""]) == 2  # an empty --out would write nothing
    assert "--out is empty" in capsys.readouterr().err
    writable = tmp_path / "new" / "report"
    monkeypatch.setattr(
        "jaxamp._src.compare.cli.compare",
        lambda config: (_ for _ in ()).throw(SystemExit(7)),  # stop right after the checks
    )
    with pytest.raises(SystemExit) as e:
        main(["compare", "--out", str(writable)])
    assert e.value.code == 7 and not (tmp_path / "new").exists()  # checked, nothing made


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variants", "fp32,fp32"], "variant(s) fp32 given more than once"),
        (["--variants", "bf16,fp16"], "lack fp32, the baseline"),
        (["--bn-recalibration", "-3"], "bn_recalibration must be >= 0"),
        (["--learning-rate", "nan"], "learning_rate must be a finite number > 0, got nan"),
        (["--learning-rate", "0"], "learning_rate must be a finite number > 0, got 0.0"),
        (["--model", "resnet18", "--heads", "4"], "heads=4 do(es) nothing for model 'resnet18'"),
        (["--train-examples", "8", "--batch-size", "32"], "batch_size 32 exceeds the 8"),
        (["--seed", "-1"], "seed must be from 0 to"),
        (["--seed", "99999999999999999999"], "seed must be from 0 to"),
        (["--model", "bert", "--vocab-size", "3"], "vocab_size must be >= 4"),
        (["--model", "resnet18", "--hidden", "30"], "hidden=30 do(es) nothing"),
    ],
)
def test_options_that_cannot_run_print_one_line_and_exit_2(argv, message, monkeypatch, capsys):
    from jaxamp._src.compare.run import Run

    def fail(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(Run, "__init__", fail)
    assert main(["compare", "--data", "embedded", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxamp compare: error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_data_that_cannot_be_had_prints_one_line_and_exits_2(monkeypatch, capsys):
    from jaxamp._src.compare import data

    def offline(*args, **kwargs):
        raise data.DatasetUnavailable("FashionMNIST cannot be downloaded here (no network)")

    monkeypatch.setattr(data, "load_fashion_mnist", offline)
    assert main(["compare", "--model", "resnet18", "--data", "tfds"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "FashionMNIST cannot be downloaded here" in err, err


def test_embedded_data_with_a_data_dir_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    """The embedded dataset ships with jaxamp: a --data-dir beside it would never be read."""
    _no_run(monkeypatch)
    assert main(["compare", "--data", "embedded", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxamp compare: error: ") and err.count("\n") == 1, err
    assert "data_dir" in err and "'embedded'" in err and str(tmp_path) in err, err


def _offline(monkeypatch):
    from jaxamp._src.compare import data

    def offline(*args, **kwargs):
        raise data.DatasetUnavailable("FashionMNIST cannot be downloaded here (no network)")

    monkeypatch.setattr(data, "load_fashion_mnist", offline)


@pytest.mark.parametrize(
    "argv",
    [
        ["--data", "embedded", "--learning-rate", "0"],  # the options alone
        ["--data", "embedded", "--data-dir", "somewhere"],
        ["--data", "embedded", "--model", "resnet18", "--heads", "4"],  # against the model
        ["--model", "resnet18", "--data", "tfds"],  # data that cannot be had
    ],
    ids=["option", "data-dir", "model", "data"],
)
def test_an_option_error_leaves_no_output_folder_behind(argv, tmp_path, monkeypatch, capsys):
    from jaxamp._src.compare.run import Run

    def fail(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(Run, "__init__", fail)
    _offline(monkeypatch)
    out = tmp_path / "new" / "report"
    assert main(["compare", *argv, "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "new").exists(), list(tmp_path.rglob("*"))
