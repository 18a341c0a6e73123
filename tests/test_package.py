"""Release hygiene: one version everywhere, a public API that is all exported, and a pure-PyTorch
core that imports without Lightning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAVE_LIGHTNING

import lightning_ndclip

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_same_in_pyproject_the_package_and_the_changelog():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    assert lightning_ndclip.__version__ == version
    releases = re.findall(r"^## \[(\d[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert releases and releases[0] == version, f"CHANGELOG's newest release {releases[:1]} != {version}"


def test_every_name_in_all_is_importable():
    for name in lightning_ndclip.__all__:
        if name in lightning_ndclip._LIGHTNING_NAMES and not HAVE_LIGHTNING:  # the core-only run
            with pytest.raises(ImportError, match=rf"lightning_ndclip\.{name} needs .*lightning_ndclip\[lightning\]"):
                getattr(lightning_ndclip, name)
            continue
        assert getattr(lightning_ndclip, name) is not None, name


def test_the_pure_pytorch_core_imports_without_lightning():
    code = (
        "import sys\n"
        "for m in ('lightning', 'lightning.pytorch', 'lightning.fabric', 'torchmetrics'): sys.modules[m] = None\n"
        "import lightning_ndclip as nd\n"
        "from lightning_ndclip.core import context, experts, loss, mesh, norm, pipeline, reduce\n"
        "assert nd.clip_grad_norm_ and nd.sync_token_count and nd.ParallelDims\n"
        "try:\n"
        "    nd.GlobalNormClip\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GlobalNormClip needs" in done.stdout
