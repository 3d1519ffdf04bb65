"""A draft model's trace along each text (specli.decoding.replay.DraftTrace): its greedy choice
and confidence at every generated position, from one batch pass over the prompt and the text,
so that replays draft with it without the model. Saved beside the texts, one line per text."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from harness.common import log, read_jsonl
from specli.decoding.replay import DraftTrace


def compute(rows: list[dict], draft: Path, out: Path, *, threads: int = 2, ctx: int = 4096) -> dict[str, DraftTrace]:
    """The trace of every row not yet in `out` (appended as it goes), then all of them."""
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend

    done = {r["id"] for r in read_jsonl(out)} if Path(out).exists() else set()
    todo = [r for r in rows if r["id"] not in done]
    if todo:
        init_backend()
        model = LlamaModel(Path(draft), n_ctx=ctx, n_threads=threads)
        t0 = time.perf_counter()
        with open(out, "a", encoding="utf-8") as f:
            for i, row in enumerate(todo):
                text = row["prompt_ids"] + row["output_ids"]
                start = len(row["prompt_ids"])
                model.reset()
                model.eval(text[: start - 1], logits="none")
                logits = model.eval(text[start - 1 : -1], logits="all")  # row j follows text[:start + j]
                choices = logits.argmax(axis=1)
                top = logits[np.arange(len(choices)), choices]
                conf = 1.0 / np.exp(logits - top[:, None]).sum(axis=1, dtype=np.float64)
                f.write(json.dumps({"id": row["id"], "start": start, "choices": choices.tolist(),
                                    "confidences": [round(float(c), 5) for c in conf]}) + "\n")
                f.flush()
                if i % 10 == 0:
                    log(f"trace [{i + 1}/{len(todo)}] {row['id']}: {len(text)} tokens, {time.perf_counter() - t0:.0f}s")
        model.close()
    return load(out)


def load(path: Path) -> dict[str, DraftTrace]:
    return {r["id"]: DraftTrace(r["start"], tuple(r["choices"]), tuple(r["confidences"])) for r in read_jsonl(path)}
