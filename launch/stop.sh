#!/usr/bin/env bash
# Stops a run on every worker (SIGTERM to the process group launch/run.sh started, SIGKILL
# after 30 s) and leaves the VM up. A later launch/run.sh with the same run directory resumes from the last checkpoint.
set -euo pipefail
# shellcheck source=launch/lib.sh source-path=SCRIPTDIR/..
source "$(dirname "$0")/lib.sh"

usage() {
  cat <<EOF2
usage: $SCRIPT --name NAME --zone ZONE --run_name RUN [options]

Stops RUN on every worker (--worker=all); the TPU VM keeps running (and billing).

required:
  --name NAME        TPU VM name
  --zone ZONE        its zone
  --run_name RUN     the run to stop
options:
  --project PROJECT  Google Cloud project (default: gcloud's configured project)
  --dry-run          print the command, run nothing
  -h, --help         this help
EOF2
}

RUN_NAME=""
while (($#)); do
  option_name "$1"
  case $OPT in
    run_name) take "$@"; RUN_NAME=$VALUE ;;
    *) common_option "$@" ;;
  esac
  shift "$TAKEN"
done

check_common
[[ -n $RUN_NAME ]] || die "--run_name is required (the name launch/run.sh printed)"
check_run_name "$RUN_NAME"

base=$REMOTE_RUNS/$RUN_NAME
# SIGTERM to the run's process group (run.sh started it as a session leader), up to 30 s to
# exit, then SIGKILL: a host stuck in a collective whose peers are gone never exits by itself.
remote="$REMOTE_ALIVE; pid=\$(cat $base.pid 2>/dev/null || true)"
remote+="; if ! alive \"\$pid\"; then echo \"\$(hostname): $RUN_NAME is not running\"; exit 0; fi"
remote+="; kill -TERM -- \"-\$pid\"; for _ in \$(seq 30); do alive \"\$pid\" || break; sleep 1; done"
remote+="; if alive \"\$pid\"; then kill -KILL -- \"-\$pid\"; how=SIGKILL; else how=SIGTERM; fi"
remote+="; echo \"=== \$(date -u +%FT%TZ) \$(hostname) stopped by launch/stop.sh (\$how)\" >> $base.log"
remote+="; echo \"\$(hostname): stopped $RUN_NAME (pid \$pid, \$how)\""

run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" --worker=all "--command=$remote"
