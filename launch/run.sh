#!/usr/bin/env bash
# Starts one training run on every worker of a TPU VM from a local flag file. The flag file is
# copied to each worker, then each worker starts `python -m rhyme_jax.main --flagfile=...` in
# the background, detached from the ssh session (setsid + nohup), writing its own log and pid
# under ~/rhyme_jax_runs/. One process per host: on a pod slice every worker must run the same
# command, and jax.distributed finds the other hosts through the VM's metadata server.
#
# The run directory should be on gs://: workers' disks are not shared and die with the VM,
# while checkpoints in a bucket outlive it and let a preempted run resume on a new VM.
set -euo pipefail
# shellcheck source=launch/lib.sh source-path=SCRIPTDIR/..
source "$(dirname "$0")/lib.sh"

usage() {
  cat <<EOF
usage: $SCRIPT --name NAME --zone ZONE --flagfile FILE [options] [-- MAIN_FLAGS...]

Copies FILE to every worker (--worker=all) and starts rhyme_jax.main with it there, in the
background; each worker logs to ~/$REMOTE_RUNS/RUN_NAME.log. Flags after '--' are passed to
rhyme_jax.main after the flag file, so they override it (e.g. -- --num_steps=100).

required:
  --name NAME        TPU VM name
  --zone ZONE        its zone
  --flagfile FILE    a local rhyme_jax flag file (e.g. configs/qwen2_5_7b_tpu_v5p.flags)
options:
  --run_dir DIR      run directory, overriding the flag file's (use gs://BUCKET/...)
  --run_name NAME    names the log/pid files (default: the run directory's last component)
  --env KEY=VALUE    environment variable for the run (repeatable; e.g. LIBTPU_INIT_ARGS=...)
  --project PROJECT  Google Cloud project (default: gcloud's configured project)
  --dry-run          print the commands, run nothing
  -h, --help         this help
EOF
}

FLAGFILE=""
RUN_DIR=""
RUN_NAME=""
ENVS=()
MAIN_FLAGS=()
while (($#)); do
  option_name "$1"
  case $1 in
    --) shift; MAIN_FLAGS=("$@"); break ;;
  esac
  case $OPT in
    flagfile) take "$@"; FLAGFILE=$VALUE ;;
    run_dir) take "$@"; RUN_DIR=$VALUE ;;
    run_name) take "$@"; RUN_NAME=$VALUE ;;
    env)
      take "$@"
      [[ $VALUE =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env '$VALUE' must be KEY=VALUE"
      ENVS+=("$VALUE")
      ;;
    *) common_option "$@" ;;
  esac
  shift "$TAKEN"
done

check_common
[[ -n $FLAGFILE ]] || die "--flagfile is required (e.g. configs/qwen2_5_1_5b_tpu_v5e.flags)"
[[ -f $FLAGFILE ]] || die "--flagfile '$FLAGFILE' does not exist"
for flag in ${MAIN_FLAGS[@]+"${MAIN_FLAGS[@]}"}; do
  [[ $flag == --* ]] || die "'$flag' after '--' is not a flag (rhyme_jax.main takes --flag=value)"
done

# The run directory the run will use: the last one rhyme_jax.main reads (absl: last wins), from
# the flag file, then --run_dir, then flags after '--'.
effective_run_dir=$(sed -n 's/^[[:space:]]*--run_dir=//p' "$FLAGFILE" | tail -n 1)
effective_run_dir=${RUN_DIR:-$effective_run_dir}
for flag in ${MAIN_FLAGS[@]+"${MAIN_FLAGS[@]}"}; do
  if [[ $flag == --run_dir=* ]]; then
    effective_run_dir=${flag#--run_dir=}
  fi
done
if [[ -z $RUN_NAME ]]; then
  RUN_NAME=$(basename "${effective_run_dir:-$FLAGFILE}")
  RUN_NAME=${RUN_NAME%.flags}
fi
check_run_name "$RUN_NAME"
if [[ $effective_run_dir != gs://* ]]; then
  warn "run dir '${effective_run_dir:-<default>}' is on each worker's own disk: checkpoints of a" \
    "multi-host run are split across hosts and lost with the VM; use --run_dir=gs://BUCKET/..."
fi

# On the workers, relative to ~/rhyme_jax (where relative paths in flag files resolve).
base=../$REMOTE_RUNS/$RUN_NAME
main=(../"$REMOTE_VENV"/bin/python -m rhyme_jax.main "--flagfile=$base.flags")
if [[ -n $RUN_DIR ]]; then
  main+=("--run_dir=$RUN_DIR")
fi
main+=(${MAIN_FLAGS[@]+"${MAIN_FLAGS[@]}"})
exports="export PYTHONUNBUFFERED=1"
for kv in ${ENVS[@]+"${ENVS[@]}"}; do
  exports+=" $(shell_quote "$kv")"
done
remote="set -euo pipefail; $REMOTE_ALIVE; cd $REMOTE_REPO"
remote+="; if alive \"\$(cat $base.pid 2>/dev/null)\"; then"
remote+=" echo \"\$(hostname): $RUN_NAME is already running (pid \$(cat $base.pid)); stop it with launch/stop.sh\" >&2; exit 1; fi"
remote+="; $exports"
remote+="; echo \"=== \$(date -u +%FT%TZ) \$(hostname) start\" >> $base.log"
remote+="; setsid nohup $(shell_quote "${main[@]}") >> $base.log 2>&1 < /dev/null &"
remote+=" echo \$! > $base.pid; echo \"\$(hostname): started $RUN_NAME, pid \$!, log ~/$REMOTE_RUNS/$RUN_NAME.log\""

run gcloud compute tpus tpu-vm scp "$FLAGFILE" "$TPU_NAME:$REMOTE_RUNS/$RUN_NAME.flags" "${LOCATION[@]}" --worker=all
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" --worker=all "--command=$remote"
