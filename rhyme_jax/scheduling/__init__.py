"""Scheduling: which request runs when and where, never what it samples.

predictor.py   response lengths from past epochs (rank-based) and the tail hook
               (`LengthPredictor.remaining_work`: expected tokens left per live request)
admission.py   admission order: static (fifo, random, history longest-first, cross-step
               alternation, oracle) and online (Seer probe-first; longest expected
               remaining first for divided rollout) behind `next_to_admit`
engine_order.py
               `EngineOrder`: a policy as the rollout engine's order (`generate(admission=)`)
assignment.py  groups to data-parallel shards / hosts by LPT, identical on every host
plan.py        `plan_step`: the trainer's one call (shards + order); `SCHEDULES`, the
               choices of the trainer's `--schedule`
step_time.py   measured step times per (bucket, budget) and the speculation cost rule
simulate.py    a discrete-event model of the SPMD rollout (bench/schedsim.py drives it)
"""
