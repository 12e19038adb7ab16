#!/usr/bin/env bash
# Creates a Cloud TPU VM: one host (v5litepod-8, v6e-8, ...) or a pod slice of several hosts
# (v5p-32, v4-32, ...), which gcloud creates as one resource whose workers are then addressed
# together with --worker=all. With --queued the request waits in a queued resource until
# capacity frees up instead of failing at once; --spot asks for cheaper, preemptible capacity.
set -euo pipefail
# shellcheck source=launch/lib.sh source-path=SCRIPTDIR/..
source "$(dirname "$0")/lib.sh"

usage() {
  cat <<EOF
usage: $SCRIPT --name NAME --zone ZONE --accelerator_type TYPE [options]

Creates a Cloud TPU VM (a single host or a pod slice). It bills from creation until
launch/teardown.sh deletes it, whether or not anything runs on it.

required:
  --name NAME               TPU VM name (lower-case letters, digits, '-')
  --zone ZONE               zone that has the accelerator (e.g. us-central2-b, us-west4-a)
  --accelerator_type TYPE   v5litepod-8 (1 host), v5p-32 (4 hosts), v6e-8, v4-32, ...
options:
  --runtime_version V       TPU software version; default by TPU generation:
                            v2/v3/v4 tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite,
                            v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e
  --spot                    spot capacity: much cheaper, may be preempted at any time
  --queued                  create through a queued resource (waits for capacity)
  --valid_until_duration D  with --queued: give up if not provisioned within D (e.g. 6h)
  --service_account EMAIL   service account of the workers (default: the project's
                            Compute Engine default account); it needs write access to
                            the gs:// bucket of your run directories
  --scopes SCOPES           its access scopes, e.g. cloud-platform (IAM roles then decide)
  --project PROJECT         Google Cloud project (default: gcloud's configured project)
  --dry-run                 print the gcloud command, run nothing
  -h, --help                this help
EOF
}

ACCELERATOR=""
RUNTIME=""
SPOT=0
QUEUED=0
VALID_UNTIL=""
SERVICE_ACCOUNT=""
SCOPES=""
while (($#)); do
  option_name "$1"
  case $OPT in
    accelerator_type) take "$@"; ACCELERATOR=$VALUE ;;
    runtime_version) take "$@"; RUNTIME=$VALUE ;;
    valid_until_duration) take "$@"; VALID_UNTIL=$VALUE ;;
    service_account) take "$@"; SERVICE_ACCOUNT=$VALUE ;;
    scopes) take "$@"; SCOPES=$VALUE ;;
    spot) TAKEN=1; SPOT=1 ;;
    queued) TAKEN=1; QUEUED=1 ;;
    *) common_option "$@" ;;
  esac
  shift "$TAKEN"
done

check_common
[[ -n $ACCELERATOR ]] || die "--accelerator_type is required (e.g. v5litepod-8, v5p-32)"
[[ $ACCELERATOR =~ ^v[0-9][a-z0-9]*-[0-9]+$ ]] ||
  die "--accelerator_type '$ACCELERATOR' is not a TPU type (e.g. v5litepod-8, v5p-32, v6e-8)"
if [[ -z $RUNTIME ]]; then
  case $ACCELERATOR in
    v2-* | v3-* | v4-*) RUNTIME=tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) RUNTIME=v2-alpha-tpuv5-lite ;;
    v5p-*) RUNTIME=v2-alpha-tpuv5 ;;
    v6e-*) RUNTIME=v2-alpha-tpuv6e ;;
    *) die "no default --runtime_version for '$ACCELERATOR': pass one" ;;
  esac
fi
if [[ -n $VALID_UNTIL ]] && ((!QUEUED)); then
  die "--valid_until_duration needs --queued"
fi

if ((QUEUED)); then
  cmd=(gcloud compute tpus queued-resources create "$TPU_NAME" "--node-id=$TPU_NAME" "${LOCATION[@]}"
    "--accelerator-type=$ACCELERATOR" "--runtime-version=$RUNTIME")
  if [[ -n $VALID_UNTIL ]]; then
    cmd+=("--valid-until-duration=$VALID_UNTIL")
  fi
else
  cmd=(gcloud compute tpus tpu-vm create "$TPU_NAME" "${LOCATION[@]}"
    "--accelerator-type=$ACCELERATOR" "--version=$RUNTIME")
fi
if [[ -n $SERVICE_ACCOUNT ]]; then
  cmd+=("--service-account=$SERVICE_ACCOUNT")
fi
if [[ -n $SCOPES ]]; then
  cmd+=("--scopes=$SCOPES")
fi
if ((SPOT)); then
  cmd+=(--spot)
fi
run "${cmd[@]}"
if ((QUEUED && !DRY_RUN)); then
  echo "queued: the VM exists once this shows ACTIVE:" \
    "$(shell_quote gcloud compute tpus queued-resources describe "$TPU_NAME" "${LOCATION[@]}")" >&2
fi
