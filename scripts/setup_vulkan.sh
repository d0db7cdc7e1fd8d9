#!/usr/bin/env bash
# Make sure wgpu can find a GPU adapter; install Mesa's software Vulkan driver (lavapipe) if not.
#
# Idempotent and silent when an adapter is already available. Otherwise, on Debian/Ubuntu as
# root it installs mesa-vulkan-drivers + libvulkan1; anywhere else it prints what to install for
# Debian/Ubuntu, Fedora, Arch and macOS and exits 1.
#
# Environment: PYTHON (default python3) is the interpreter whose wgpu is checked.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
WGPU_REQ='wgpu>=0.32,<0.33'
APT_PACKAGES=(mesa-vulkan-drivers libvulkan1)

log() { echo "setup_vulkan: $*" >&2; }

# 0: wgpu found a Vulkan/Metal/D3D12 adapter; 1: it did not; 2: wgpu cannot be imported.
# The probe's stderr is held back and shown only when it finds no adapter: without a Wayland
# session Mesa's device-select Vulkan layer prints "XDG_RUNTIME_DIR is invalid" even when all
# is well (meganeura itself turns that layer off: meganeura/runtime/device.py), but the reason
# a probe failed must stay visible.
wgpu_adapter_status() {
    local err status=0
    err=$("$PYTHON" - 2>&1 >/dev/null <<'PY'
import sys
try:
    import wgpu
except ImportError:
    sys.exit(2)
try:
    backends = {a.info["backend_type"] for a in wgpu.gpu.enumerate_adapters_sync()}
except Exception as e:
    sys.exit(f"enumerating adapters failed: {type(e).__name__}: {e}")
# An OpenGL adapter alone does not count: Mesa offers one even without any Vulkan driver, and
# meganeura's compute path targets Vulkan, Metal or D3D12.
if not backends & {"Vulkan", "Metal", "D3D12"}:
    sys.exit(f"no Vulkan, Metal or D3D12 adapter (found: {sorted(backends) or 'none'})")
PY
) || status=$?
    if [ "$status" -eq 1 ] && [ -n "$err" ]; then
        printf '%s\n' "$err" | sed 's/^/setup_vulkan: probe: /' >&2
    fi
    return "$status"
}

# Fallback when wgpu cannot be installed (offline): a Vulkan loader plus at least one ICD.
system_vulkan_present() {
    local icd
    if command -v vulkaninfo >/dev/null 2>&1 && vulkaninfo --summary >/dev/null 2>&1; then
        return 0
    fi
    ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1' || return 1
    for icd in /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json; do
        [ -e "$icd" ] && return 0
    done
    return 1
}

adapter_available() {
    local status=0
    wgpu_adapter_status || status=$?
    if [ "$status" -eq 2 ]; then
        if PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q --disable-pip-version-check \
            "$WGPU_REQ" >/dev/null 2>&1; then
            status=0
            wgpu_adapter_status || status=$?
        fi
    fi
    case "$status" in
        0) return 0 ;;
        2) system_vulkan_present ;;  # no wgpu at all: judge by the system libraries alone
        *) return 1 ;;
    esac
}

print_instructions() {
    cat >&2 <<'TXT'
setup_vulkan: no WebGPU adapter found. Install a Vulkan driver (Mesa's lavapipe runs on any CPU):
  Debian/Ubuntu:  sudo apt-get install -y mesa-vulkan-drivers libvulkan1
  Fedora:         sudo dnf install -y mesa-vulkan-drivers vulkan-loader
  Arch:           sudo pacman -S --needed vulkan-swrast vulkan-icd-loader
  macOS:          nothing to install (wgpu uses Metal); check that `pip install "wgpu>=0.32,<0.33"` works
  Windows:        nothing to install (wgpu uses DX12 or the GPU vendor's Vulkan driver)
Then check with:  python3 -c "import wgpu; print(wgpu.gpu.request_adapter_sync().info)"
TXT
}

if adapter_available; then
    exit 0
fi

if [ "$(uname -s)" = Linux ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null \
    && [ "$(id -u)" -eq 0 ]; then
    log "no adapter; installing ${APT_PACKAGES[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -qq >/dev/null \
        && apt-get install -y -qq --no-install-recommends "${APT_PACKAGES[@]}" >/dev/null; then
        if adapter_available; then
            log "ok: Vulkan driver installed"
            exit 0
        fi
        log "installed ${APT_PACKAGES[*]} but wgpu still finds no adapter"
    else
        log "apt-get failed (see above)"
    fi
fi

print_instructions
exit 1
