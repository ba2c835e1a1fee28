"""Prompt and record files: JSONL I/O (plain or gzipped) and the one reader of prompt files.

Every command that takes ``--prompts`` (bench, tune, eval-heads, train-heads' ``--eval-prompts``)
reads the file through ``read_prompts``, so all of them accept the same two shapes: one object per
line with a ``prompt`` string, or MT-Bench's question file, whose ``turns`` list gives the first
turn. The distillation data (``training/distill.py``) is JSONL too, usually gzipped.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO


def _open(path: Path, mode: str) -> TextIO:
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> Path:
    """One JSON object per line; gzipped when the name ends in ``.gz``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open(path, "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The objects of a JSONL file (``.gz``: gzipped), skipping blank lines."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    with _open(path, "r") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}: line {n}: not valid JSON ({exc.msg})") from None


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from JSONL with a ``prompt`` string per line, or MT-Bench's ``turns`` (the first turn).

    Raises FileNotFoundError for a missing file and ValueError, naming the line, for anything else
    that is not a prompt; ``limit`` keeps the first N.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts: list[str] = []
    for n, row in enumerate(read_jsonl(path), 1):
        turns = row.get("turns") if isinstance(row, dict) else None
        text = row.get("prompt") if isinstance(row, dict) else None
        if text is None and isinstance(turns, list) and turns:
            text = turns[0]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: line {n} has neither a 'prompt' string nor a non-empty 'turns' list")
        prompts.append(text)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts[:limit] if limit else prompts
