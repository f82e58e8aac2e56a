"""Tests for jaxamp/_src/compare/cli.py: flags, errors and the files ``--out`` writes."""

import json
import subprocess
import sys

import pytest

from jaxamp._src.compare.cli import build_parser, main


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


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--variants", "fp32,fp8"],
            "unknown variant(s) fp8; valid choices: fp32, tf32, bf16, fp16",
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
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "variant" in printed and "fp16" in printed and "speed-up" in printed
    report = json.loads((out / "report.json").read_text())
    assert [r["variant"] for r in report["runs"]] == ["fp32", "fp16"]
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
