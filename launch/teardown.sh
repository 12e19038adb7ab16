#!/usr/bin/env bash
# Deletes a TPU VM (all its workers and their disks). Billing stops only when this completes;
# everything not in a gs:// bucket is gone with the VM.
set -euo pipefail
# shellcheck source=launch/lib.sh source-path=SCRIPTDIR/..
source "$(dirname "$0")/lib.sh"

usage() {
  cat <<EOF2
usage: $SCRIPT --name NAME --zone ZONE [options]

Deletes the TPU VM NAME, with its workers' disks (logs, anything not on gs://).

required:
  --name NAME        TPU VM name
  --zone ZONE        its zone
options:
  --queued           it was created with launch/create.sh --queued: delete the queued
                     resource and its VM together
  --yes              do not ask for confirmation (gcloud --quiet)
  --project PROJECT  Google Cloud project (default: gcloud's configured project)
  --dry-run          print the command, run nothing
  -h, --help         this help
EOF2
}

QUEUED=0
YES=0
while (($#)); do
  option_name "$1"
  case $OPT in
    queued) TAKEN=1; QUEUED=1 ;;
    yes) TAKEN=1; YES=1 ;;
    *) common_option "$@" ;;
  esac
  shift "$TAKEN"
done

check_common
if ((QUEUED)); then
  cmd=(gcloud compute tpus queued-resources delete "$TPU_NAME" "${LOCATION[@]}" --force)
else
  cmd=(gcloud compute tpus tpu-vm delete "$TPU_NAME" "${LOCATION[@]}")
fi
if ((YES)); then
  cmd+=(--quiet)
fi
run "${cmd[@]}"
