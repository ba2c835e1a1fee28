"""Issue 38 probe: how many prompt tokens a prefix cache could reuse in ticket-triage.

For every ticket of ``graphs/workflows/evals/ticket_triage.jsonl`` it builds the token ids that one run sends
to the engine, exactly as the nodes do:
  classify_category, classify_priority: ``Engine.encode_prompt(render(TICKET))`` -> ``Engine.hidden_states``
  extract_product, extract_problem:     ``Engine.encode_with_offsets("{subject}\\n{body}")`` (raw text)
  choose_opening:                       ``Engine.encode_prompt`` of its chat prompt -> constrained generation
and reports, processing calls in graph order through an ideal prefix (radix) cache that keeps everything:
within one run (cold cache per run) and across runs (one shared cache, runs one after another), the share of
prompt tokens that would be hits, plus exact-duplicate calls. Tokenizer only: no forward runs.

    .venv/bin/python benchmarks/batching_probe/prefix_overlap.py \
        --out benchmarks/batching_probe/prefix_overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from elesium.config import Settings
from elesium.graphs.workflows import ticket_triage as tt
from elesium.inference.weights.loading import load_weights

EVALS = Path(tt.__file__).resolve().parent / "evals" / "ticket_triage.jsonl"
OPENING_PROMPT = (
    "A customer wrote to support:\nSubject: {subject}\n{body}\n\nWhich sentence should open our reply?"
)


class Radix:
    """An ideal prefix cache over token ids (a trie); ``insert`` returns the matched prefix length."""

    def __init__(self) -> None:
        self.root: dict = {}

    def insert(self, ids: list[int]) -> int:
        node, hit, matching = self.root, 0, True
        for t in ids:
            if t in node and matching:
                hit += 1
            else:
                matching = False
            node = node.setdefault(t, {})
        return hit


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    settings = Settings.from_env()
    tok = load_weights(settings.model, settings.cache_dir).tokenizer
    rows = [json.loads(line) for line in EVALS.read_text().splitlines() if line.strip()]

    def chat(text: str) -> list[int]:
        return tok.encode_chat([{"role": "user", "content": text}])

    per_run = []
    shared = Radix()
    shared_total = shared_hit = 0
    header = None
    for r in rows:
        s = r["input"]
        calls = {
            "classify_category": chat(tt.TICKET.format(**s)),
            "classify_priority": chat(tt.TICKET.format(**s)),
            "extract_product": tok.encode_with_offsets(f"{s['subject']}\n{s['body']}")[0],
            "extract_problem": tok.encode_with_offsets(f"{s['subject']}\n{s['body']}")[0],
            "choose_opening": chat(OPENING_PROMPT.format(**s)),
        }
        if header is None:
            header = lcp(calls["classify_category"], calls["choose_opening"])
        own = Radix()
        total = sum(len(v) for v in calls.values())
        hits = {k: own.insert(v) for k, v in calls.items()}
        for v in calls.values():
            shared_total += len(v)
            shared_hit += shared.insert(v)
        per_run.append(
            {
                "id": r["id"],
                "tokens": {k: len(v) for k, v in calls.items()},
                "hits_within_run": hits,
                "hit_rate_within_run": round(sum(hits.values()) / total, 3),
                "opening_vs_ticket_lcp": lcp(calls["classify_category"], calls["choose_opening"]),
            }
        )
    res = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": "2-core CPU, shared (tokenizer only)",
        "tickets": len(rows),
        "chat_header_tokens_shared_by_every_chat_prompt": header,
        "median_tokens_per_run": statistics.median(sum(p["tokens"].values()) for p in per_run),
        "median_hit_rate_within_run": statistics.median(p["hit_rate_within_run"] for p in per_run),
        "mean_hit_rate_within_run": round(statistics.mean(p["hit_rate_within_run"] for p in per_run), 3),
        "hit_rate_across_runs_shared_cache": round(shared_hit / shared_total, 3),
        "median_opening_vs_ticket_lcp": statistics.median(p["opening_vs_ticket_lcp"] for p in per_run),
        "median_tokens_by_call": {
            k: statistics.median(p["tokens"][k] for p in per_run) for k in per_run[0]["tokens"]
        },
        "runs": per_run[:5],
    }
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
