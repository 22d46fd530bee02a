"""The project's own bar: the README's test command is what CI runs; the core stays light."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- test-command -->\n```sh\n(.+)\n```", text)
    assert match, "README.md must hold the test command in a sh block after <!-- test-command -->"
    return match.group(1)


@pytest.mark.slow
def test_ci_runs_exactly_the_readme_test_command() -> None:
    out = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run"), "--print-command"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert out == readme_test_command()


def test_readme_test_command_sets_up_a_fresh_machine() -> None:
    line = readme_test_command()
    steps = [s.strip() for s in line.split("&&")]
    assert steps[0].startswith("python3 -m venv .venv")
    # torch first, from the local CPU wheel: a plain requirement would pull a CUDA build.
    torch_at = steps.index("pip install torch==2.13.0")
    dev_at = steps.index("pip install -e '.[dev]'")
    assert torch_at < dev_at
    assert steps[-1].startswith("python -m pytest")


@pytest.mark.slow
def test_core_imports_without_frameworks() -> None:
    code = (
        "import sys\n"
        "import gradientmail, gradientmail.errors, gradientmail.clock, gradientmail.events\n"
        "import gradientmail.mailbox, gradientmail.algorithms.schedule\n"
        "import gradientmail.learner, gradientmail.syncer, gradientmail.run.protocol\n"
        "import gradientmail.adapters, gradientmail.backends, gradientmail.wire.compression\n"
        "heavy = sorted(m for m in ('torch', 'boto3', 'zstandard', 'lightning', 'accelerate')"
        " if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == "", f"the core imported {out} at module level"


def test_public_names() -> None:
    import gradientmail
    import gradientmail.errors as errors

    assert gradientmail.__version__ == "0.1.0"
    assert set(gradientmail.__all__) >= {
        "DiLoCo", "WeightedMean", "Rda", "ByBytes", "Strided", "Learner", "Syncer",
        "open_mailbox", "GradientmailError", "__version__",
    }
    for name in gradientmail.__all__:
        assert hasattr(gradientmail, name), name
    for name in (
        "GradientmailError",
        "ProtocolError",
        "SchemaMismatch",
        "RunConfigMismatch",
        "MissingExtra",
    ):
        assert name in errors.__all__
        cls = getattr(errors, name)
        assert issubclass(cls, errors.GradientmailError)


def test_every_error_derives_from_the_base() -> None:
    import gradientmail.errors as errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.GradientmailError), name


def test_missing_extra_names_the_install_line() -> None:
    from gradientmail.errors import MissingExtra

    err = MissingExtra("zstd", "zstd payloads")
    assert str(err) == (
        "the optional dependency 'zstd' is needed for zstd payloads; "
        "install it with: pip install 'gradientmail[zstd]'"
    )
    assert err.extra == "zstd"


PUBLIC = {
    "gradientmail.errors": ["GradientmailError", "ProtocolError", "SchemaMismatch",
                            "RunConfigMismatch", "MissingExtra"],
    "gradientmail.wire.tensor_bytes": ["TensorBytes"],
    "gradientmail.wire.serialization": ["Schema", "ParameterSpec", "pack", "unpack", "validate"],
    "gradientmail.wire.quantization": ["quantize", "dequantize"],
    "gradientmail.wire.compression": ["encode", "decode"],
    "gradientmail.backends": ["NumpyBackend", "TorchBackend"],
    "gradientmail.algorithms.diloco": ["DiLoCoAggregator", "DiLoCo"],
    "gradientmail.algorithms.merge": ["weight", "weighted_mean", "rda", "nesterov", "mean_cosine",
                                      "WeightedMean", "Rda"],
    "gradientmail.algorithms.partition": ["plan", "ByBytes", "Strided"],
    "gradientmail.algorithms.rounds": ["grace_window"],
    "gradientmail.adapters": ["TorchAdapter"],
    "gradientmail.mailbox": ["Mailbox", "LocalMailbox", "S3Mailbox", "MemoryMailbox",
                             "open_mailbox"],
    "gradientmail.learner.runtime": ["Learner"],
    "gradientmail.syncer.runtime": ["Syncer"],
    "gradientmail_lightning": ["DiLoCoCallback"],
    "gradientmail_accelerate": ["DiLoCoPlugin", "DiLoCo"],
}


def test_every_public_name_of_the_design_is_exported() -> None:
    import importlib

    for module, names in PUBLIC.items():
        mod = importlib.import_module(module)
        for name in names:
            assert name in mod.__all__, f"{module}.__all__ lacks {name}"
            assert hasattr(mod, name), f"{module} lacks {name}"


def test_every_module_declares_all() -> None:
    import importlib
    import pkgutil

    for package in ("gradientmail", "gradientmail_lightning", "gradientmail_accelerate"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, package + "."):
            mod = importlib.import_module(info.name)
            assert isinstance(getattr(mod, "__all__", None), list | tuple), info.name
