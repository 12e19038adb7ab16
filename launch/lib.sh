# shellcheck shell=bash disable=SC2034  # variables here are read by the scripts that source it
# Shared by the launch/*.sh scripts (sourced, never run): option parsing, one-line errors, and
# `run`, which either prints a command exactly as it would be typed (--dry-run) or runs it.
#
# Options are spelled with underscores, as rhyme_jax's own flags are (--accelerator_type);
# the gcloud spelling with hyphens is accepted too. `--opt VALUE` and `--opt=VALUE` both work.

# Paths on every TPU VM worker, relative to the login user's home directory.
readonly REMOTE_REPO=rhyme_jax        # the project, unpacked from a git archive
readonly REMOTE_VENV=rhyme_venv       # its Python environment (the images' Python is too old)
readonly REMOTE_RUNS=rhyme_jax_runs   # per run: NAME.flags, NAME.log, NAME.pid
# Shell function for the workers: is process $1 alive? `kill -0` alone also says yes for a
# zombie, which an init that does not reap (some containers) leaves behind.
# shellcheck disable=SC2016  # expanded on the worker, not here
readonly REMOTE_ALIVE='alive() { ps -o stat= -p "$1" 2>/dev/null | grep -qv Z; }'

SCRIPT=$(basename "$0")
DRY_RUN=0
TPU_NAME=""
ZONE=""
PROJECT=""

# Bad or missing arguments: one line naming the option, exit status 2.
die() {
  echo "$SCRIPT: error: $*" >&2
  exit 2
}

# Anything else that stops a script before it runs a command (no gcloud, no git): status 1.
fail() {
  echo "$SCRIPT: error: $*" >&2
  exit 1
}

warn() {
  echo "$SCRIPT: warning: $*" >&2
}

# Prints its arguments as one shell command line that re-reads as the same words: words made
# only of safe characters stay bare, others are single-quoted (only the value of an
# `--option=value` word, so --command='...' reads as gcloud documents it).
shell_quote() {
  local word prefix out=()
  for word in "$@"; do
    prefix=""
    if [[ $word =~ ^--[A-Za-z0-9_-]+= ]]; then
      prefix=${BASH_REMATCH[0]}
      word=${word#"$prefix"}
    fi
    if [[ -n $word && $word =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
      out+=("$prefix$word")
    else
      out+=("$prefix'${word//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

# Runs a command, or only prints it under --dry-run. A command that runs is echoed to stderr
# first ("+ ..."), so a log shows what was done.
run() {
  if ((DRY_RUN)); then
    shell_quote "$@"
    return 0
  fi
  echo "+ $(shell_quote "$@")" >&2
  "$@"
}

# The option's name without dashes and value, hyphens read as underscores
# (`--accelerator-type=v5p-8` -> OPT=accelerator_type); OPT is empty for a word that is no option.
option_name() {
  OPT=""
  [[ $1 == -* ]] || return 0
  OPT=${1%%=*}
  OPT=${OPT#-}
  OPT=${OPT#-}
  OPT=${OPT//-/_}
}

# Reads the value of the option in $1 (from `--opt=VALUE` or from the next word $2) into VALUE
# and the number of words it used into TAKEN.
take() {
  if [[ $1 == *=* ]]; then
    VALUE=${1#*=}
    TAKEN=1
  elif (($# >= 2)) && [[ $2 != --* ]]; then
    VALUE=$2
    TAKEN=2
  else
    die "${1%%=*} needs a value"
  fi
  [[ -n $VALUE ]] || die "${1%%=*} needs a non-empty value"
}

# Options every script has. Sets TAKEN; an option no script knows is an error.
common_option() {
  option_name "$1"
  TAKEN=1
  case $OPT in
    name) take "$@"; TPU_NAME=$VALUE ;;
    zone) take "$@"; ZONE=$VALUE ;;
    project) take "$@"; PROJECT=$VALUE ;;
    dry_run) [[ $1 != *=* ]] || die "--dry-run takes no value"; DRY_RUN=1 ;;
    h | help) usage; exit 0 ;;
    "") die "unexpected argument '$1' (see $SCRIPT --help)" ;;
    *) die "unknown option ${1%%=*} (see $SCRIPT --help)" ;;
  esac
}

# Checks the options every script needs and that gcloud is there (unless --dry-run). Sets
# LOCATION, the gcloud options that place a command: --zone and, when given, --project.
check_common() {
  [[ -n $TPU_NAME ]] || die "--name is required (the TPU VM's name)"
  [[ $TPU_NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
    die "--name '$TPU_NAME' is not a valid TPU name (lower-case letters, digits, '-'; starts with a letter)"
  [[ -n $ZONE ]] || die "--zone is required (e.g. us-central2-b)"
  [[ $ZONE =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone '$ZONE' is not a zone (e.g. us-central2-b)"
  LOCATION=("--zone=$ZONE")
  if [[ -n $PROJECT ]]; then
    LOCATION+=("--project=$PROJECT")
  fi
  if ((!DRY_RUN)) && ! command -v gcloud >/dev/null; then
    fail "gcloud not found on PATH: install the Google Cloud CLI (or use --dry-run)"
  fi
}

# Checks that a run name can name files on the workers (letters, digits, '.', '_', '-').
check_run_name() {
  [[ $1 =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] ||
    die "--run_name '$1' must be letters, digits, '.', '_' or '-'"
}

# Checks a --worker value: `all` or a worker index.
check_worker() {
  [[ $1 == all || $1 =~ ^[0-9]+$ ]] || die "--worker '$1' must be 'all' or a worker index (0, 1, ...)"
}
