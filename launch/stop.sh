#!/usr/bin/env bash
# Stops a run on every worker (SIGTERM to the process group launch/run.sh started, SIGKILL
# after --grace seconds) and leaves the VM up. A later launch/run.sh with the same run directory
# resumes from the last checkpoint.
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
  --grace SECONDS    how long the run may take to exit after SIGTERM before SIGKILL (default
                     600: SIGTERM saves a checkpoint at the next step boundary, and a large
                     model's step can take minutes)
  --project PROJECT  Google Cloud project (default: gcloud's configured project)
  --dry-run          print the command, run nothing
  -h, --help         this help
EOF2
}

RUN_NAME=""
GRACE=600
while (($#)); do
  option_name "$1"
  case $OPT in
    run_name) take "$@"; RUN_NAME=$VALUE ;;
    grace) take "$@"; GRACE=$VALUE ;;
    *) common_option "$@" ;;
  esac
  shift "$TAKEN"
done

check_common
[[ -n $RUN_NAME ]] || die "--run_name is required (the name launch/run.sh printed)"
check_run_name "$RUN_NAME"
[[ $GRACE =~ ^[0-9]+$ ]] || die "--grace '$GRACE' is not a number of seconds"

base=$REMOTE_RUNS/$RUN_NAME
# SIGTERM to the run's process group (run.sh started it as a session leader), up to --grace
# seconds to exit, then SIGKILL: a host stuck in a collective whose peers are gone never exits by itself.
remote="$REMOTE_ALIVE; pid=\$(cat $base.pid 2>/dev/null || true)"
remote+="; if ! alive \"\$pid\"; then echo \"\$(hostname): $RUN_NAME is not running\"; exit 0; fi"
remote+="; kill -TERM -- \"-\$pid\"; for _ in \$(seq $GRACE); do alive \"\$pid\" || break; sleep 1; done"
remote+="; if alive \"\$pid\"; then kill -KILL -- \"-\$pid\"; how=SIGKILL; else how=SIGTERM; fi"
remote+="; echo \"=== \$(date -u +%FT%TZ) \$(hostname) stopped by launch/stop.sh (\$how)\" >> $base.log"
remote+="; echo \"\$(hostname): stopped $RUN_NAME (pid \$pid, \$how)\""

run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" --worker=all "--command=$remote"
