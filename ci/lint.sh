#!/usr/bin/env bash
# Lint and format check (ruff, configured in ruff.toml), run first by .ci/run. To fix what
# it reports: ruff check --fix . && ruff format .
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUFF_VERSION=0.17.6  # pinned: another version may format differently
PYTHON=${PYTHON:-python3}
if [ "$("$PYTHON" -m ruff --version 2>/dev/null)" != "ruff $RUFF_VERSION" ]; then
    echo "[lint] installing ruff==$RUFF_VERSION"
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q "ruff==$RUFF_VERSION"
fi
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
