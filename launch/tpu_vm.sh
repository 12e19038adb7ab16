#!/usr/bin/env bash
# One-shot form kept from before the launch/ scripts: installs this checkout on every worker
# of an existing TPU VM (launch/install.sh) and starts a run from a flag file on all of them
# (launch/run.sh). Extra flags go to rhyme_jax.main and override the flag file.
#
#   launch/tpu_vm.sh [--dry-run] TPU_NAME ZONE configs/qwen2_5_1_5b_tpu_v5e.flags [--flag=value...]
set -euo pipefail
# shellcheck source=launch/lib.sh source-path=SCRIPTDIR/..
source "$(dirname "$0")/lib.sh"

usage() {
  cat <<EOF2
usage: $SCRIPT [--dry-run] TPU_NAME ZONE FLAGFILE [MAIN_FLAGS...]

launch/install.sh then launch/run.sh on TPU_NAME; see launch/README.md for the steps one by
one (create, logs, stop, teardown) and their options.
EOF2
}

dry=()
case ${1-} in
  -h | --help) usage; exit 0 ;;
  --dry-run | --dry_run) dry=(--dry-run); shift ;;
esac
(($# >= 3)) || die "expected TPU_NAME ZONE FLAGFILE (see $SCRIPT --help)"
here=$(dirname "$0")
"$here/install.sh" --name "$1" --zone "$2" ${dry[@]+"${dry[@]}"}
"$here/run.sh" --name "$1" --zone "$2" --flagfile "$3" ${dry[@]+"${dry[@]}"} -- "${@:4}"
