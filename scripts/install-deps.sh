#!/usr/bin/env bash
# Installs the Debian packages fp4rollout builds and tests with, only those
# missing; silent when everything is present. Safe to run any number of times.
set -euo pipefail

packages=(
  build-essential pkg-config python3 valgrind
  openmpi-bin libopenmpi-dev
  libzmq3-dev libmsgpack-dev libcjson-dev libcmocka-dev libopenblas-dev libxxhash-dev libmicrohttpd-dev
  libpcre2-dev libutf8proc-dev
  python3-zmq python3-msgpack python3-numpy python3-aiohttp
  python3-venv python3-pip python3-setuptools python3-wheel
  python3-torch python3-matplotlib
  clang libclang-rt-dev chromium
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
