"""The target's greedy texts: what every drafter at temperature 0 must reproduce, and what
replays (specli.decoding.replay) are run on. One JSON line per item: prompt_ids (the exact
tokens both sides see), output_ids (ending with the end-of-generation token when the model
stopped), the rendered prompt text, and for chat items the messages."""

from __future__ import annotations

import json
import time
from pathlib import Path

from harness.common import log, read_jsonl
from harness.prompts import Item


def generate(items: list[Item], target: Path, out: Path, *, chat: bool, max_tokens: int = 160, ctx: int = 4096,
             threads: int = 2) -> list[dict]:
    """Plain greedy decoding of every item not yet in `out` (appended as it goes: resumable)."""
    from specli.decoding import loop
    from specli.decoding.generation import Request
    from specli.decoding.sampling import GREEDY
    from specli.decoding.step import SpeculativeDecoder
    from specli.llama.conversation import encode_conversation
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend
    from specli.session.chat import choose_formatter

    init_backend()
    model = LlamaModel(Path(target), n_ctx=ctx, n_threads=threads)
    decoder = SpeculativeDecoder(model, None, 0, GREEDY)
    formatter = choose_formatter(model, None)[0] if chat else None
    done = {r["id"]: r for r in read_jsonl(out)} if Path(out).exists() else {}
    eos = model.vocab_info().eos
    t0 = time.perf_counter()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        for i, item in enumerate(items):
            if item.id in done:
                continue
            row = {"id": item.id, "category": item.category, "split": item.split}
            if chat:
                messages = list(item.messages)
                if item.follows is not None:
                    first = done[item.follows]
                    messages = [*first["messages"], {"role": "assistant", "content": first["output"]}, *messages]
                ids = encode_conversation(model, formatter, None, messages)
                row["messages"] = messages
                row["prompt"] = formatter.render(None, messages)
            else:
                prompt = item.prompt
                if item.follows is not None:
                    first = done[item.follows]
                    prompt = f"{first['prompt']}{first['output']}\n{prompt}"
                ids = model.tokenize(prompt, add_bos=model.vocab_info().add_bos)
                row["prompt"] = prompt
            if len(ids) + max_tokens + 1 > ctx:
                log(f"skipped {item.id}: {len(ids)} prompt tokens")
                continue
            gen = loop.generate(decoder, Request(ids, max_tokens=max_tokens)).run()
            output_ids = list(gen.token_ids)
            if gen.stop_reason == "eos":
                output_ids.append(eos)  # the target's last choice: a pass makes it
            row.update(output=gen.text, prompt_ids=ids, output_ids=output_ids, stop=gen.stop_reason)
            done[item.id] = row
            f.write(json.dumps(row) + "\n")
            f.flush()
            log(f"[{i + 1}/{len(items)}] {item.id} ({item.category}): {len(ids)}+{len(output_ids)} tokens, "
                f"{time.perf_counter() - t0:.0f}s")
    model.close()
    by_id = {r["id"]: r for r in read_jsonl(out)}
    return [by_id[i.id] for i in items if i.id in by_id]
