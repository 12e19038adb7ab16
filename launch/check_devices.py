"""Prints one line about this host's JAX devices: run on every TPU VM worker after installing.

  python launch/check_devices.py
  -> t1v-n-1234-w-0: process 0 of 4, 4 local TPU v5p devices of 16 (backend tpu, jax 0.x)

On a pod slice every worker must run it at the same time (launch/install.sh does, with
--worker=all), since the TPU runtime starts on all hosts together. A worker whose backend is
not `tpu` means the `tpu` extra (libtpu) did not install there.
"""

import socket

import jax


def main() -> None:
  local = jax.local_devices()
  kind = local[0].device_kind if local else "no"
  print(f"{socket.gethostname()}: process {jax.process_index()} of {jax.process_count()}, "
        f"{len(local)} local {kind} devices of {jax.device_count()} "
        f"(backend {jax.default_backend()}, jax {jax.__version__})")


if __name__ == "__main__":
  main()
