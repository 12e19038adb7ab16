#!/usr/bin/env bash
# Shows a run's log from one worker (default 0, the process that prints progress) or from all
# of them, each line prefixed by its host, with whether the run is still alive there.
# --follow keeps streaming (tail -F) until interrupted.
set -euo pipefail
# shellcheck source=launch/lib.sh source-path=SCRIPTDIR/..
source "$(dirname "$0")/lib.sh"

usage() {
  cat <<EOF2
usage: $SCRIPT --name NAME --zone ZONE --run_name RUN [options]

Prints whether RUN is running on a worker and the end of its log (~/$REMOTE_RUNS/RUN.log).

required:
  --name NAME        TPU VM name
  --zone ZONE        its zone
  --run_name RUN     the run (launch/run.sh printed it; default there: the run dir's last part)
options:
  --worker W         worker index, or 'all' (lines then prefixed by host; default 0)
  --lines N          lines to show (default 50)
  --follow           keep streaming new lines (Ctrl-C to stop)
  --project PROJECT  Google Cloud project (default: gcloud's configured project)
  --dry-run          print the command, run nothing
  -h, --help         this help
EOF2
}

RUN_NAME=""
WORKER=0
LINES=50
FOLLOW=0
while (($#)); do
  option_name "$1"
  case $OPT in
    run_name) take "$@"; RUN_NAME=$VALUE ;;
    worker) take "$@"; WORKER=$VALUE ;;
    lines) take "$@"; LINES=$VALUE ;;
    follow | f) TAKEN=1; FOLLOW=1 ;;
    *) common_option "$@" ;;
  esac
  shift "$TAKEN"
done

check_common
[[ -n $RUN_NAME ]] || die "--run_name is required (the name launch/run.sh printed)"
check_run_name "$RUN_NAME"
check_worker "$WORKER"
[[ $LINES =~ ^[0-9]+$ ]] || die "--lines '$LINES' must be a number"

base=$REMOTE_RUNS/$RUN_NAME
tail_cmd="tail -n $LINES"
if ((FOLLOW)); then
  tail_cmd+=" -F"
fi
tail_cmd+=" $base.log"
if [[ $WORKER == all ]]; then
  tail_cmd+=" | sed -u \"s/^/[\$(hostname)] /\""
fi
remote="$REMOTE_ALIVE; if alive \"\$(cat $base.pid 2>/dev/null)\"; then state=\"running (pid \$(cat $base.pid))\"; else state=\"not running\"; fi"
remote+="; echo \"== \$(hostname) $RUN_NAME: \$state\""
remote+="; if [ -f $base.log ]; then $tail_cmd; else echo \"\$(hostname): no log $base.log\" >&2; exit 1; fi"

run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" "--worker=$WORKER" "--command=$remote"
