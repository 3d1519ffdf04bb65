"""Fill-in-the-middle prompts for /infill, token for token as llama-server builds them
(tools/server/server-common.cpp, format_prompt_infill), so an editor gets the completion it
would get from llama-server on the same model.

With the repo-level tokens (<|repo_name|> and <|file_sep|>, Qwen2.5-Coder's; arXiv 2409.12186):

    [FIM_REP]myproject\\n [FIM_SEP]{filename}\\n{text} ... [FIM_SEP]filename\\n
    [FIM_PRE]{prefix}[FIM_SUF]{suffix}[FIM_MID]{prompt}

Without them each extra chunk follows a "\\n\\n--- snippet ---\\n\\n" separator. llama-server's
rules, kept as they are: the prefix keeps its last 3*(n_batch/4) tokens and the suffix its first
n_batch/4 - 2 - len(prompt), with n_batch llama-server's default batch (2048, its -b); the extra
context gets the last n_ctx - n_batch - 2*n_predict tokens of what the chunks make (n_predict: the
server's -n, -1 without one), so a context of 2048 tokens holds at most 2 of them; BOS, when the
model adds one, goes after the extra context; `prompt` goes right after the prefix (before the
suffix token: llama-server's layout, whatever its comment says), the middle token last.
Texts are tokenized without special tokens (a `<|file_sep|>` typed in a file is text); `prompt`
with them, as llama-server tokenizes it.

One departure: llama-server's shares can overfill the context (-c 4096 without -n gives the
extra context 2,050 tokens beside up to 2,050 of prefix, suffix and FIM tokens), and llama-server
then refuses the request ("exceeds the available context size"); here the extra context gives
way (its oldest tokens first) so that the prompt leaves `n_room` tokens for the completion.
Wherever llama-server's prompt leaves that room, the two prompts are the same.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from specli.llama.model import LlamaModel

LLAMA_SERVER_BATCH = 2048  # llama-server's default -b, which its FIM layout is sized by
PREFIX_TAKE = 3 * (LLAMA_SERVER_BATCH // 4)  # the prefix's last tokens kept (1,536)
SUFFIX_TAKE = LLAMA_SERVER_BATCH // 4 - 2  # the suffix's first tokens kept, less the prompt's (510)
REPO_NAME = "myproject\n"  # llama-server's placeholders for the project and the current file
CURRENT_FILE = "filename\n"
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # before each extra chunk, without <|file_sep|>
MISSING_NAMES = {"pre": "prefix (<|fim_prefix|>)", "suf": "suffix (<|fim_suffix|>)", "mid": "middle (<|fim_middle|>)"}

Mixed = Union[str, Sequence[Union[str, int]]]  # a text, or llama-server's mix of texts and token ids


def missing_tokens(fim: dict[str, Optional[int]]) -> list[str]:
    """The FIM tokens /infill needs that the model lacks, named for an error message."""
    return [name for key, name in MISSING_NAMES.items() if fim.get(key) is None]


def tokenize_mixed(model: LlamaModel, value: Mixed, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
    """llama-server's tokenize_mixed: a string, or a list of strings and token ids (ids as they
    are; only a first string gets BOS with add_special). Ids are checked by the caller."""
    if isinstance(value, str):
        return model.tokenize(value, add_bos=add_special, parse_special=parse_special)
    tokens: list[int] = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            tokens += model.tokenize(part, add_bos=add_special and i == 0, parse_special=parse_special)
        else:
            tokens.append(int(part))
    return tokens


def infill_prompt(
    model: LlamaModel, fim: dict[str, Optional[int]], *, prefix: Mixed, suffix: Mixed, extra: Sequence[tuple[str, str]],
    prompt: str = "", n_ctx: int, n_predict: int = -1, n_batch: int = LLAMA_SERVER_BATCH, n_room: int = 1,
) -> list[int]:
    """The prompt's tokens: `extra` as (filename, text) chunks; needs fim's pre, suf and mid.
    n_predict: the server's -n (-1: none), which llama-server sizes the extra context by;
    n_room: the tokens the extra context leaves free for the completion (at least 1). The prompt
    is still n_ctx tokens or more when the prefix, prompt and suffix alone take that much (the
    caller refuses it)."""
    text = lambda s: model.tokenize(s, add_bos=False, parse_special=False)  # noqa: E731
    tokens_prefix = tokenize_mixed(model, prefix)
    tokens_suffix = tokenize_mixed(model, suffix)
    tokens_prompt = model.tokenize(prompt, add_bos=False, parse_special=True) if prompt else []
    rep, sep = fim.get("rep"), fim.get("sep")

    extra_tokens: list[int] = []
    if rep is not None:
        extra_tokens += [rep, *text(REPO_NAME)]
    for filename, chunk in extra:
        if sep is not None:
            extra_tokens += [sep, *text(filename + "\n")]
        else:
            extra_tokens += text(CHUNK_SEPARATOR)
        extra_tokens += text(chunk)
    if sep is not None:
        extra_tokens += [sep, *text(CURRENT_FILE)]

    quarter = n_batch // 4
    n_prefix_take = min(len(tokens_prefix), 3 * quarter)
    n_suffix_take = min(len(tokens_suffix), max(0, quarter - (2 + len(tokens_prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))

    head = [fim["pre"], *tokens_prefix[len(tokens_prefix) - n_prefix_take :], *tokens_prompt]
    tail = [fim["suf"], *tokens_suffix[:n_suffix_take]]
    info = model.vocab_info()
    if info.add_bos:
        head.insert(0, info.bos)
    n_extra_take = min(n_extra_take, max(0, n_ctx - len(head) - len(tail) - 1 - max(1, n_room)))  # (the departure above)
    taken = extra_tokens[len(extra_tokens) - n_extra_take :] if n_extra_take else []
    return [*taken, *head, *tail, fim["mid"]]
