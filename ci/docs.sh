#!/usr/bin/env bash
# The docs stage (.ci/run): builds the guides in docs/ as a site with MkDocs (mkdocs.yml) in
# strict mode, so that a broken link or anchor, a page missing from the nav or an API
# docstring that no longer resolves fails it. The pinned packages (docs/requirements.txt) go
# into a throwaway virtual environment, and the site into a temporary folder, not the checkout.
# mkdocstrings reads the package's source statically: no torch or Horovod needed.
# Times: docs/tests.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore NO_MKDOCS_2_WARNING=1

log() { echo "[docs] $*"; }

work=$(mktemp -d -t hvd_compress-docs.XXXXXX)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
"$PYTHON" -m venv "$work/venv"
log "installing docs/requirements.txt into a throwaway virtual environment"
"$work/venv/bin/python" -m pip install -q -r docs/requirements.txt
log "mkdocs build --strict (after $((SECONDS - started)) s of set-up)"
"$work/venv/bin/mkdocs" build --strict --site-dir "$work/site"
log "done in $((SECONDS - started)) s"
