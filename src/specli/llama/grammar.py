"""A model's vocabulary as llguidance's tokenizer (the `structured` extra), for constraints on
the output (specli.constraints). Built once per loaded model, in about a second for a 150k-token
vocabulary; the model must outlive it (the tokenizer keeps the vocabulary's pointer)."""

from __future__ import annotations

import warnings
from typing import Any

from specli.errors import UsageError
from specli.llama.model import LlamaModel

_TOKENIZERS: dict[int, tuple[LlamaModel, Any]] = {}  # id(model) -> (model, its tokenizer)

MISSING = ("structured output needs the llguidance package: pip install 'specli[structured]' "
           "(or pip install llguidance)")


def import_llguidance():
    """The llguidance module; UsageError with the install line when it is not installed."""
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 (the bitmask helpers)
    except ImportError:
        raise UsageError(MISSING) from None
    return llguidance


def grammar_tokenizer(model: LlamaModel):
    """llguidance's LLTokenizer for `model`'s vocabulary, every end-of-generation token its EOS
    (a grammar that is complete allows any of them)."""
    cached = _TOKENIZERS.get(id(model))
    if cached is not None and cached[0] is model:
        return cached[1]
    import_llguidance()
    import llguidance.llamacpp

    eog = [t for t in range(model.n_vocab) if model.is_eog(t)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (it reads token attributes through a deprecated call)
        tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(model._vocab, n_vocab=model.n_vocab, eos_token=eog or None)
    _TOKENIZERS[id(model)] = (model, tokenizer)
    return tokenizer
