"""Draft trees from suffix matches over indexed sequences: the readable reference.

The drafting rule, defined here in plain Python and compiled in `history.fast_draft` (the two are
property-tested to build the same trees):

Inputs. Indexed *segments* (token arrays, each opening with the START sentinel: past responses
of the prompt and the live responses of its group), each of a *kind* (0 = history, 1 =
siblings) and a weight (history: `recency ** age_in_epochs`; siblings: 1). The *context* is the
requester's own segment's last `max_match` tokens.

1. Matches. Every position p of a segment with a next token (p + 1 < len) whose token equals
   the context's last one is a candidate; its match length m(p) is how many tokens, ending at p,
   agree with the context's tail (at most the context's length).
2. Levels, per kind (the root fallback): the longest match l0 of the kind, then l0 - 1, ... down
   to 1, at most `max_levels` levels, stopping after the first level whose candidates (those
   with m >= l) continue with >= 2 distinct tokens. Level i of kind k has mixture weight
   `kind_weight[k] * decay ** i`, spread over its candidates in proportion to their segment
   weights. A candidate's weight is the sum over the levels it belongs to.
3. Tree. Every candidate continues with its segment's following tokens. A tree node is a token
   path from the root; its probability is its parent's times (weight of candidates continuing
   through it) / (weight of candidates continuing from the parent at all): a weighted count
   trie, normalised over continuations. Built depth by depth: children appear in the order
   their first candidate appears; children below `min_prob` are dropped, and so is every
   child but the `budget` most probable of its depth (stable order) — neither can be in the
   final tree. Candidates in dropped nodes stop.
4. Output. The `budget` most probable nodes (ties: earlier depth, then creation order), in
   that order: best first, parents before children (a child is never more probable than its
   parent), so every prefix of the output is itself a tree. Returned with path probabilities.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

START = -1  # opens every indexed segment (matches the context's START, never drafted)


def draft_reference(segments: Sequence[tuple[np.ndarray, int, float]], context: Sequence[int],
                    budget: int, *, min_prob: float, decay: float, max_levels: int,
                    kind_weights: tuple[float, float]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens int32[n], parents int32[n], probs float32[n]), n <= budget, best-first order."""
  ctx = [int(t) for t in context]
  empty = (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))
  if budget <= 0 or not ctx:
    return empty
  # 1. candidates: (segment, position, match length)
  cands = []
  for s, (toks, kind, w) in enumerate(segments):
    toks = [int(t) for t in toks]
    for p in range(len(toks) - 1):
      if toks[p] != ctx[-1]:
        continue
      m = 1
      while m < len(ctx) and p - m >= 0 and toks[p - m] == ctx[-1 - m]:
        m += 1
      cands.append((s, p, m))
  # 2. levels per kind -> candidate weights. A candidate of match length m belongs to levels
  # l <= m, so its weight is seg_weight * scale[kind][m], scale[m] = sum over included l <= m
  # of lam_l / W_l (W_l: the segment weight of level l, summed from the longest m down).
  scale = []
  for kind in (0, 1):
    by_m = [0.0] * (len(ctx) + 1)  # segment weight of this kind's candidates with m == l
    nexts_by_m = [set() for _ in range(len(ctx) + 1)]
    for s, p, m in cands:
      if segments[s][1] == kind:
        by_m[m] += float(segments[s][2])
        nexts_by_m[m].add(int(segments[s][0][p + 1]))
    share = [0.0] * (len(ctx) + 1)  # lam_l / W_l of included levels
    lam, total, nexts, levels = float(kind_weights[kind]), 0.0, set(), 0
    for level in range(len(ctx), 0, -1):
      total += by_m[level]
      nexts |= nexts_by_m[level]
      if total == 0.0:
        continue  # no candidate this long
      if levels == max_levels:
        break
      share[level] = lam / total
      levels += 1
      if len(nexts) >= 2:  # this level branches: stop falling back
        break
      lam *= decay
    scale.append(list(itertools.accumulate(share)))
  weight = [float(segments[s][2]) * scale[segments[s][1]][m] for s, _, m in cands]
  # 3. depth-by-depth weighted trie
  live = [(cands[i][0], cands[i][1], weight[i], -1) for i in range(len(cands)) if weight[i] > 0]
  node_tok, node_par, node_prob, node_depth = [], [], [], []
  depth = 0
  while live and depth < budget:
    depth += 1
    child_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> index in `new`
    new: list[list] = []  # [parent, token, weight]
    out_w: dict[int, float] = {}  # parent -> weight continuing from it
    moved = []
    for s, p, w, node in live:
      toks = segments[s][0]
      if p + 1 >= len(toks):
        continue
      tok = int(toks[p + 1])
      key = (node, tok)
      if key not in child_of:
        child_of[key] = len(new)
        new.append([node, tok, 0.0])
      new[child_of[key]][2] += w
      out_w[node] = out_w.get(node, 0.0) + w
      moved.append((s, p + 1, w, child_of[key]))
    # base * (share <= 1): a child is never more probable than its parent, even in floats
    probs = [(node_prob[par] if par >= 0 else 1.0) * (w / out_w[par]) for par, _, w in new]
    keep = [j for j in range(len(new)) if probs[j] >= min_prob]
    keep = sorted(sorted(keep, key=lambda j: -probs[j])[:budget])
    final = {}
    for j in keep:
      final[j] = len(node_tok)
      node_tok.append(new[j][1])
      node_par.append(new[j][0])
      node_prob.append(probs[j])
      node_depth.append(depth)
    live = [(s, p, w, final[j]) for s, p, w, j in moved if j in final]
  # 4. best first
  order = sorted(range(len(node_tok)), key=lambda i: (-node_prob[i], node_depth[i], i))[:budget]
  new_index = {old: k for k, old in enumerate(order)}
  tokens = np.array([node_tok[i] for i in order], np.int32)
  parents = np.array([-1 if node_par[i] < 0 else new_index[node_par[i]] for i in order], np.int32)
  return tokens, parents, np.array([node_prob[i] for i in order], np.float32)
