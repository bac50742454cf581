"""Suffix decoding: drafts from how often token strings followed the current context, in this request (its
prompt and output so far) and in the outputs of earlier requests, with no draft model.

`SuffixTree` counts token strings (tree.py); `SuffixCache` shares a global tree across requests and threads and
saves it (cache.py, files.py); `propose_suffix_draft` turns the counts into a scored token tree (draft.py).
"""

from hf_specdec.suffix.cache import SuffixCache, SuffixCacheInfo, SuffixRequest
from hf_specdec.suffix.config import SuffixConfig
from hf_specdec.suffix.draft import EMPTY_DRAFT, SuffixDraft, propose_suffix_draft
from hf_specdec.suffix.files import tokenizer_fingerprint
from hf_specdec.suffix.tree import SuffixTree

__all__ = [
    "EMPTY_DRAFT",
    "SuffixCache",
    "SuffixCacheInfo",
    "SuffixConfig",
    "SuffixDraft",
    "SuffixRequest",
    "SuffixTree",
    "propose_suffix_draft",
    "tokenizer_fingerprint",
]
