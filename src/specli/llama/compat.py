"""Can this draft model speak for this target? (llama.cpp's rule, common/speculative.cpp)

Drafts are token ids, so both models must mean the same thing by every id: same vocabulary type,
same BOS and EOS, vocabulary sizes within 128 of each other (padding differs between exports),
and identical token texts from id 5 on (the first few are special tokens that exports name
differently). The two numbers live in specli/gguf.py, a floor below this package, where
models/fit.py (which imports nothing of specli.llama) reads them too, to check a pair on its
headers before anything is loaded.
"""

from __future__ import annotations

from typing import Callable

from specli.errors import IncompatibleDraftError
from specli.gguf import FIRST_CHECKED_TOKEN_ID, MAX_VOCAB_SIZE_DIFFERENCE
from specli.llama.model import VOCAB_TYPE_NAMES, VocabInfo


def check_compatible(
    info_tgt: VocabInfo,
    info_dft: VocabInfo,
    text_tgt: Callable[[int], bytes],
    text_dft: Callable[[int], bytes],
) -> None:
    """Raise IncompatibleDraftError naming the first difference; return None if compatible."""
    fix = "pick a draft model from the target's family (same tokenizer)"
    if info_tgt.vocab_type != info_dft.vocab_type:
        raise IncompatibleDraftError(
            f"draft and target use different tokenizer types "
            f"(target {VOCAB_TYPE_NAMES.get(info_tgt.vocab_type, info_tgt.vocab_type)}, "
            f"draft {VOCAB_TYPE_NAMES.get(info_dft.vocab_type, info_dft.vocab_type)}); {fix}"
        )
    for what, t, d in (("BOS", info_tgt.bos, info_dft.bos), ("EOS", info_tgt.eos, info_dft.eos)):
        if t != d:
            raise IncompatibleDraftError(f"draft and target have different {what} tokens (target {t}, draft {d}); {fix}")
    difference = abs(info_tgt.n_tokens - info_dft.n_tokens)
    if difference > MAX_VOCAB_SIZE_DIFFERENCE:
        raise IncompatibleDraftError(
            f"draft and target vocabularies differ in size by {difference} tokens "
            f"(target {info_tgt.n_tokens}, draft {info_dft.n_tokens}; at most {MAX_VOCAB_SIZE_DIFFERENCE} allowed); {fix}"
        )
    for token in range(FIRST_CHECKED_TOKEN_ID, min(info_tgt.n_tokens, info_dft.n_tokens)):
        a, b = text_tgt(token), text_dft(token)
        if a != b:
            raise IncompatibleDraftError(
                f"draft and target disagree on token {token} (target {a.decode('utf-8', 'replace')!r}, "
                f"draft {b.decode('utf-8', 'replace')!r}); {fix}"
            )
