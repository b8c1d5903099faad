#!/usr/bin/env bash
# Everything README's test command needs on a fresh Debian machine, run as root (a
# container, a CI image: no sudo needed) or as a user with sudo:
# - Debian's espeak-ng (spoken digits), fortunes (labelled text), chromium and a font
#   (report.html rendered headless);
# - the project in .venv with its test extras (pytest, ruff, mypy, bandit, modelscan, ...);
# - checkov in a venv of its own, .venv-tools (it pins packaging below what pytest needs);
#   the manifest tests find it there.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null; then
  SUDO="sudo"
else
  echo "scripts/setup_tests.sh: the Debian packages need root: run as root, or install sudo" >&2
  exit 2
fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng fortunes chromium \
  fonts-dejavu-core >/dev/null
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
python3 -m venv .venv-tools
.venv-tools/bin/python -m pip install --quiet "checkov>=3.2,<4"
