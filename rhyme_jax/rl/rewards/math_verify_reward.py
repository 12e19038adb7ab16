"""LaTeX / boxed answers checked symbolically with the `math-verify` package, timeout-safe.

math-verify bounds its sympy work with `signal.alarm`, which only works in the main thread: in
any other thread `parse` / `verify` raise ValueError. `verify_answer` therefore
  * in the main thread (Unix) calls math-verify directly with its own signal timeouts;
  * elsewhere (a reward thread pool, a grain worker thread) runs the check in a separate
    worker process, where it is the main thread so math-verify's alarms work again, and
    waits at most a hard deadline; a process that overruns it is killed and replaced.
Either way a hung or failing check scores 0 instead of stalling or crashing the run.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing
import os
import signal
import threading
from typing import Any, Callable

from rhyme_jax.rl.rewards.registry import (RewardResult, example_field, example_meta,
                                           register_reward)

_log = logging.getLogger(__name__)
_POOL: concurrent.futures.ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
# Extra seconds granted to the worker process: start-up (spawn + imports) on first use.
_WORKER_GRACE_S = 30.0


def _gold_text(example: Any) -> str:
  """The reference as LaTeX: `meta['target']`, else the text after the last '####', else the
  whole answer (math-verify extracts the boxed / final expression from it)."""
  meta = example_meta(example)
  if "target" in meta:
    return str(meta["target"])
  answer = example_field(example, "answer")
  return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer


def _parse_gold(gold: str, timeout_s: int | None):
  import math_verify  # pylint: disable=import-outside-toplevel
  parsed = math_verify.parse(gold, parsing_timeout=timeout_s)
  # Bare LaTeX such as '\\frac{1}{2}' needs math delimiters to be found; prose does not get
  # wrapped (math-verify would read 'no answer' as a product of symbols).
  looks_latex = any(c in gold for c in "\\^{_")
  if not parsed and looks_latex and not gold.lstrip().startswith("$"):
    parsed = math_verify.parse(f"${gold}$", parsing_timeout=timeout_s)
  return parsed


def check_in_this_thread(gold: str, completion: str, timeout_s: int | None
                         ) -> tuple[bool, str | None]:
  """(correct, extracted answer) with math-verify; needs the main thread if timeout_s is set."""
  import math_verify  # pylint: disable=import-outside-toplevel
  gold_parsed = _parse_gold(gold, timeout_s)
  if not gold_parsed:
    raise ValueError(f"math_verify reward: cannot parse the reference answer {gold!r}")
  pred_parsed = math_verify.parse(completion, parsing_timeout=timeout_s)
  if not pred_parsed:
    return False, None
  ok = math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s)
  return bool(ok), str(pred_parsed[-1])


def _worker_check(gold: str, completion: str, timeout_s: int) -> tuple[bool, str | None]:
  """Runs in the worker process's main thread, so math-verify's signal timeouts work."""
  try:
    return check_in_this_thread(gold, completion, timeout_s)
  except ValueError:
    raise
  except Exception:  # pylint: disable=broad-except
    return False, None


def _pool() -> concurrent.futures.ProcessPoolExecutor:
  global _POOL
  with _POOL_LOCK:
    if _POOL is None:
      # 'spawn', not fork: forking a process that runs JAX / XLA threads can deadlock.
      _POOL = concurrent.futures.ProcessPoolExecutor(
          max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    return _POOL


def _take_pool() -> concurrent.futures.ProcessPoolExecutor | None:
  """The pool, now dropped (the next call starts a new one); None if there was none."""
  global _POOL
  with _POOL_LOCK:
    pool, _POOL = _POOL, None
  return pool


def shutdown_pool() -> None:
  """Stops the worker process and drops the pool. Runs at exit, while the modules its
  executor's callbacks use are still loaded: an executor left for the interpreter's teardown
  to collect prints an "Exception ignored" traceback there."""
  pool = _take_pool()
  if pool is not None:
    pool.shutdown(wait=True, cancel_futures=True)


atexit.register(shutdown_pool)


def _kill_pool() -> None:
  """Terminate the worker process (it overran its deadline); the next call starts a new one."""
  pool = _take_pool()
  if pool is not None:
    for proc in list(getattr(pool, "_processes", {}).values()):
      proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def call_in_worker(fn: Callable, args: tuple, deadline_s: float):
  """Run a picklable `fn(*args)` in the worker process; raises TimeoutError after deadline_s
  (the worker is killed, so no runaway computation is left behind)."""
  future = _pool().submit(fn, *args)
  try:
    return future.result(timeout=deadline_s)
  except concurrent.futures.TimeoutError as e:
    _kill_pool()
    raise TimeoutError(f"worker call {getattr(fn, '__name__', fn)} exceeded {deadline_s}s"
                       ) from e
  except concurrent.futures.process.BrokenProcessPool:
    _kill_pool()
    raise


def signals_usable() -> bool:
  """True where math-verify's SIGALRM timeouts work: the main thread on a POSIX system."""
  return (os.name == "posix" and hasattr(signal, "SIGALRM")
          and threading.current_thread() is threading.main_thread())


def verify_answer(gold: str, completion: str, timeout_s: int = 5) -> tuple[bool, str | None]:
  """(correct, extracted) for a LaTeX reference vs a completion; False on timeout/failure."""
  if timeout_s <= 0:
    raise ValueError(f"math_verify reward: timeout_s must be > 0, got {timeout_s}")
  try:
    if signals_usable():
      return check_in_this_thread(gold, completion, timeout_s)
    # Parsing and verifying each get timeout_s inside the worker; 3x covers both, plus start-up.
    return call_in_worker(_worker_check, (gold, completion, timeout_s),
                          3 * timeout_s + _WORKER_GRACE_S)
  except ValueError:
    raise  # An unparseable reference is a data bug, not a wrong answer.
  except Exception as e:  # pylint: disable=broad-except
    _log.warning("math_verify reward: check failed (%s: %s); scoring 0", type(e).__name__, e)
    return False, None


@register_reward("math_verify")
def math_verify_reward(timeout_s: int = 5):
  """1.0 if math-verify finds the completion's final answer equal to the reference."""

  def score(completion: str, example: Any) -> RewardResult:
    ok, extracted = verify_answer(_gold_text(example), completion, timeout_s)
    return RewardResult(float(ok), {"correct": float(ok),
                                    "found_answer": float(extracted is not None)}, extracted)

  return score
