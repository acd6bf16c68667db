#!/usr/bin/env bash
# Install the Debian packages named as arguments that are not installed yet (apt-get, with sudo
# when not root). Idempotent: does nothing when all are installed. Exits non-zero if apt fails.
set -euo pipefail
missing=()
for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
# A fresh container has empty package lists: update only when apt cannot find a package.
if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
    $sudo apt-get update -q
fi
echo "apt-install: apt-get install ${missing[*]}"
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
