"""Markdown of `bench_generate --batch_sizes` (bench_generate_batch's JSON document)."""


def _f(x, fmt: str = '.2f') -> str:
  return '-' if x is None else format(x, fmt)


def markdown(doc: dict) -> str:
  """The whole report: throughput, forced-decoding loss, phases, FLOP books, the frontier."""
  q = doc['quality']
  lines = [f'# bench_generate --batch_sizes ({doc["date"]}, {doc["model"]})', '',
           f'machine: {doc["machine"]}; load average {doc["loadavg"]}', '',
           (f'quality ({q.get("quality_on", "cached semantics, val")}): A0 '
            f'{q["a0_loss"]:.4f}, A1 ({q["policy"]}) {q["a1_loss"]:.4f} at '
            f'eps {q["eps"]:.0e} (matched: {q["matched"]})' if 'a0_loss' in q
            else f'no quality (random init), eps {q["eps"]:.2e}'), '',
           '| B | A0 tok/s lockstep (depth-wise) | A1 depth-wise tok/s (all-rows) | A1 lockstep '
           'tok/s | loops A0 / A1 | loop saving | time saving (all-rows) | realized / loop '
           '(all-rows) | realized / loop vs the faster A0 (its engine) |',
           '|' + '---|' * 9]
  for b, r in doc['batches'].items():
    a0, a1, al, ls = r['a0'], r['a1_depthwise'], r['a1_allrows'], r['a1_lockstep']
    lines.append(f'| {b} | {a0["tokens_per_s"]:.0f} ({r["a0_depthwise"]["tokens_per_s"]:.0f}) '
                 f'| {a1["tokens_per_s"]:.0f} '
                 f'({al["tokens_per_s"]:.0f}) | {ls["tokens_per_s"]:.0f} | '
                 f'{a0["mean_loops"]:.2f} / {a1["mean_loops"]:.2f} | {a1["loop_saving"]:.1%} | '
                 f'{a1["time_saving"]:.1%} ({al["time_saving"]:.1%}) | '
                 f'{_f(a1["realized_over_loop"])} ({_f(al["realized_over_loop"])}) | '
                 f'{_f(a1["realized_over_loop_best_a0"])} ({a1["best_a0_engine"]}) |')
  return '\n'.join(lines + _forced(doc) + _phases(doc) + _flops(doc) + _frontier(doc)) + '\n'


def _forced(doc: dict) -> list:
  """Forced decoding: each engine's loss on the fed validation tokens, from the timed calls."""
  if doc.get('decode_tokens') != 'forced':
    return []
  keys = ('a0', 'a1_depthwise', 'a1_waiting', 'a1_lockstep')
  lines = ['', 'Forced decoding: every engine decodes the validation text after its prompt; '
           'loss on those tokens (masked as in training), from the timed calls.', '',
           '| B | tokens scored | loss A0 / depth-wise / waiting / lockstep | A1 - A0 |',
           '|' + '---|' * 4]
  for b, r in doc['batches'].items():
    losses_ = [r[k]['forced_loss'] for k in keys]
    lines.append(f'| {b} | {r["a0"]["forced_tokens"]:.0f} | '
                 + ' / '.join(f'{x:.4f}' for x in losses_) + f' | {losses_[1] - losses_[0]:+.4f} |')
  return lines


def _phases(doc: dict) -> list:
  """The decode phase (call - prefill, paired per round), the prefill, and end to end."""
  lines = ['', f'Per phase (A1 prefill engine: {doc.get("prefill_engine")}; waiting: '
           f'depth-wise with wait_rows {doc.get("wait_rows") or "B"}); end to end: the loop '
           'saving over prompt + generated tokens.', '',
           '| B | decode tok/s A0 / depth-wise / waiting / lockstep | decode realized / loop: '
           'depth-wise; waiting; lockstep | prefill ms A0 / depth-wise / lockstep (prompt loops '
           'A0 / A1) | end-to-end realized / loop (all tokens): depth-wise; waiting; lockstep |',
           '|' + '---|' * 5]
  for b, r in doc['batches'].items():
    a0, a1, wt, ls = r['a0'], r['a1_depthwise'], r['a1_waiting'], r['a1_lockstep']
    tok = ' / '.join(_f(x['decode_tokens_per_s'], '.0f') for x in (a0, a1, wt, ls))
    dec = '; '.join(_f(x['decode_realized_over_loop']) for x in (a1, wt, ls))
    e2e = '; '.join(_f(x['realized_over_loop_all_tokens']) for x in (a1, wt, ls))
    lines.append(
        f'| {b} | {tok} | {dec} | {a0["prefill_s"] * 1e3:.2f} / '
        f'{a1["prefill_s"] * 1e3:.2f} / {ls["prefill_s"] * 1e3:.2f} '
        f'({a0["prompt_mean_loops"]:.2f} / {a1["prompt_mean_loops"]:.2f}) | {e2e} |')
  return lines


def _flops(doc: dict) -> list:
  """The decode phase's FLOP books: saving as executed, realized / FLOP, the own-loops bound."""
  lines = ['', 'Decode phase, FLOPs as executed (books.decode_flops of each engine\'s counts); '
           'own loops: an engine that ran each token\'s own loops, one readout, a free check.',
           '', '| B | GFLOP / token A0 | FLOP saving: depth-wise; waiting; lockstep | realized '
           '/ FLOP: depth-wise; waiting; lockstep | own-loops FLOP saving / loop saving |',
           '|' + '---|' * 5]
  for b, r in doc['batches'].items():
    v = [r[k] for k in ('a1_depthwise', 'a1_waiting', 'a1_lockstep')]
    lines.append(f'| {b} | {r["a0"]["decode_flops"] / 1e9:.5f} | '
                 + '; '.join(_f(x['decode_flop_saving'], '.1%') for x in v) + ' | '
                 + '; '.join(_f(x['decode_realized_over_flops']) for x in v)
                 + f' | {_f(v[2]["own_loops_over_loop"])} |')
  return lines


def _frontier(doc: dict) -> list:
  """A1 against the cheapest uniform depth of matched quality, timed in the same rounds."""
  q = doc['quality']
  if 'match_depth' not in q:
    return []
  lines = ['', f'The frontier: A1 against uniform depth {q["match_depth"]}, the smallest whose '
           f'loss ({q["match_loss"]:.4f}, measured as A1\'s above) is within {q["tol"]} nats '
           f'of A0\'s ({q["a0_loss"]:.4f}; A1 {q["a1_loss"]:.4f}). Speed: the uniform depth\'s '
           'time over A1\'s (> 1: A1 is faster), same rounds, the uniform depth on the faster '
           'of its two engines (lockstep, depth-wise).', '',
           '| B | loops uniform / A1 | uniform engine | decode tok/s uniform | decode speed A1 '
           'vs uniform: depth-wise; waiting; lockstep | end to end: depth-wise; waiting; '
           'lockstep | forced loss uniform / A1 |', '|' + '---|' * 7]
  keys = ('a1_depthwise', 'a1_waiting', 'a1_lockstep')
  for b, r in doc['batches'].items():
    engine = r['a1_depthwise']['match_engine']
    u = r[doc['match_key'] + ('_depthwise' if engine == 'depthwise' else '')]
    dec = '; '.join(_f(r[k]['decode_speed_vs_match']) for k in keys)
    e2e = '; '.join(_f(r[k]['speed_vs_match']) for k in keys)
    forced = (f'{u["forced_loss"]:.4f} / {r["a1_waiting"]["forced_loss"]:.4f}'
              if 'forced_loss' in u else '-')
    lines.append(f'| {b} | {u["mean_loops"]:.2f} / {r["a1_waiting"]["mean_loops"]:.2f} | '
                 f'{engine} | {_f(u["decode_tokens_per_s"], ".0f")} | {dec} | {e2e} | {forced} |')
  return lines
