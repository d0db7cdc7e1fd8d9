#!/usr/bin/env bash
# Install the Debian packages some tests need beyond the Vulkan driver (setup_vulkan.sh):
# espeak-ng, whose synthesized speech the Whisper transcription test transcribes
# (tests/models/test_whisper_real.py), and chromium, whose headless WebGPU (SwiftShader) runs
# exported bundles in the browser tests (tests/web/test_browser.py).
#
# Idempotent and quiet: does nothing when every command is already there. On Debian/Ubuntu as
# root (CI) it installs what is missing with apt-get and fails when apt-get does; anywhere else
# it says what is missing and exits 0 (the tests that need it skip, saying why), so `make setup`
# still works for users without root.
set -euo pipefail

# command -> Debian package
declare -A PACKAGES=([espeak-ng]=espeak-ng [chromium]=chromium)

log() { echo "setup_debian_packages: $*" >&2; }

missing=()
for cmd in "${!PACKAGES[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("${PACKAGES[$cmd]}")
done
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(uname -s)" = Linux ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null \
    && [ "$(id -u)" -eq 0 ]; then
    log "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -qq >/dev/null \
        && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
        exit 0
    fi
    log "apt-get failed to install ${missing[*]} (see above)"
    exit 1
fi
log "not installed: ${missing[*]} (Debian/Ubuntu: sudo apt-get install -y ${missing[*]}); the tests that need them will skip"
