"""A quiet start: Mesa's device-select layer stays off unless asked for, errors still show.

Without a Wayland session the layer prints ``error: XDG_RUNTIME_DIR is invalid or not set`` on
every adapter enumeration (see ``runtime/device.py``, ``_quiet_vulkan_device_select``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import meganeura
from meganeura.runtime import device

# The checkout under test, first on the subprocess's path (not whichever meganeura is installed).
ROOT = Path(meganeura.__file__).resolve().parent.parent


def _run_cli(*argv: str) -> subprocess.CompletedProcess:
    drop = {"XDG_RUNTIME_DIR", "WAYLAND_DISPLAY", "NODEVICE_SELECT", "MEGANEURA_ADAPTER"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    for name in device._DEVICE_SELECT_REQUESTS:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "meganeura", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.gpu
def test_info_without_xdg_runtime_dir_prints_no_loader_noise(gpu_device):
    result = _run_cli("info")
    assert result.returncode == 0, result.stderr
    assert f"adapter:      {gpu_device.info.get('device', '')}" in result.stdout
    assert "XDG_RUNTIME_DIR" not in result.stderr, result.stderr


@pytest.mark.gpu
def test_a_real_error_still_reaches_stderr(gpu_device):
    result = _run_cli("--adapter", "no-such-adapter-anywhere", "info")
    assert result.returncode != 0
    assert "no adapter matches 'no-such-adapter-anywhere'" in result.stderr
    assert device.describe_adapter(gpu_device.info) in result.stderr  # the adapters listed
    assert "XDG_RUNTIME_DIR" not in result.stderr, result.stderr


def _clear(monkeypatch):
    monkeypatch.delenv("NODEVICE_SELECT", raising=False)
    for name in device._DEVICE_SELECT_REQUESTS:
        monkeypatch.delenv(name, raising=False)


def test_layer_is_turned_off_by_default(monkeypatch):
    _clear(monkeypatch)
    device._quiet_vulkan_device_select()
    assert os.environ["NODEVICE_SELECT"] == "1"


def test_a_users_nodevice_select_is_kept(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv("NODEVICE_SELECT", "0")
    device._quiet_vulkan_device_select()
    assert os.environ["NODEVICE_SELECT"] == "0"


@pytest.mark.parametrize("request_var", device._DEVICE_SELECT_REQUESTS)
def test_asking_the_layer_to_choose_keeps_it_on(monkeypatch, request_var):
    _clear(monkeypatch)
    monkeypatch.setenv(request_var, "1")
    device._quiet_vulkan_device_select()
    assert "NODEVICE_SELECT" not in os.environ
