#!/usr/bin/env bash
# The README's test command under other torch releases, each in a venv of its own (the local one stays
# as it is): for every VERSION, a venv with torch==VERSION, dgpipe's test install, then `python -m pytest -q`;
# the log goes to OUT/torch-VERSION.log and the last line of each run is printed.
#
#   bash benchmarks/torch_versions.sh OUT VERSION...      e.g. benchmarks/results/torch_versions/2026-11-26 2.14.1
#
# TORCH_INDEX: an index to take torch from (e.g. https://download.pytorch.org/whl/cpu for CPU wheels; default:
# pip's configured indexes, where PyPI serves the CUDA wheels). VENVS: where the venvs go (default
# /tmp/dgpipe-torch-venvs). The tests of
# CompressedPipelineStage check torch's private pipelining internals: a version whose suite passes here
# belongs in dgpipe.pipelining.stage.TESTED_TORCH.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: torch_versions.sh OUT VERSION...}
shift
[ $# -gt 0 ] || { echo "usage: torch_versions.sh OUT VERSION..." >&2; exit 2; }
INDEX=${TORCH_INDEX:-}
VENVS=${VENVS:-/tmp/dgpipe-torch-venvs}
mkdir -p "$OUT" "$VENVS"
status=0
for version in "$@"; do
    venv=$VENVS/torch-$version
    log=$OUT/torch-$version.log
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q ${INDEX:+--extra-index-url "$INDEX"} "torch==$version"
    # dgpipe without its dependencies, then those of it and its test extra but torch, so that the version under
    # test stays even where it is outside setup.py's range
    "$venv/bin/python" -m pip install -q --no-deps -e .
    "$venv/bin/python" - <<'PY' > "$venv/requirements.txt"
import re
from importlib.metadata import requires

for r in requires("dgpipe"):
    name, _, marker = r.partition(";")
    if re.match(r"torch([<>=!~ ]|$)", name.strip()) or (marker and 'extra == "test"' not in marker):
        continue
    print(name.strip())
PY
    "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt" "torch==$version"
    {
        echo "\$ python -m pytest -q   # $(date -u +%F), torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'), $(nproc) cores"
        "$venv/bin/python" -m pytest -q -p no:cacheprovider 2>&1
    } > "$log" || status=1
    echo "torch $version: $(tail -n 1 "$log")"
done
exit $status
