#!/usr/bin/env bash
# Installs the Debian packages the demo, the real-data tests and the browser tests use, when run as root.
# Otherwise prints the apt-get line to run; with --required that is an error (exit 1). With --demo only the demo's
# packages (the openclipart clip art: PNGs and the SVGs whose metadata become captions); the demo opens no browser,
# so `make demo` does not ask for chromium.
set -euo pipefail
required=0 demo=0
for arg in "$@"; do
  case "$arg" in
    --required) required=1 ;;
    --demo) demo=1 ;;
    *) echo "usage: scripts/apt-deps.sh [--required] [--demo]" >&2; exit 2 ;;
  esac
done
PACKAGES=(openclipart-png openclipart-svg)
[ "$demo" = 1 ] || PACKAGES+=(chromium chromium-driver)  # chromium: the `vlprep view` browser tests
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  exit 0
fi
echo "missing Debian packages; run: sudo apt-get install -y ${missing[*]}"
[ "$required" = 1 ] && exit 1
exit 0
