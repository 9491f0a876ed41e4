"""The data side: from a `data.*` config to step-indexed batches. Each module imports only those
above it in this list:

- `tokenizer.py`: the byte tokenizer, Hugging Face tokenizers (pretrained, or a BPE trained here);
- `objectives.py`: what a batch holds for each `data.objective` (causal, mlm, span, seq2seq,
  prefix) and the extra ids it needs (`Vocab`: the mask token, sentinels);
- `sources.py`: reading `data.source` into documents (stdlib, files, Hugging Face datasets, the
  synthetic tasks), each failure one line (`DataError`);
- `splits.py`: training and validation divided by the source's split, a hash, the documents' tails
  or `data.val_source`; the fingerprints the token cache is keyed by;
- `cache.py`: the run's tokenizer (`make_tokenizer`) and the memory-mapped token cache;
- `batches.py`: windows and pairs read from the cache, the seeded samplers and the mixture
  schedule, so batch `i` is a pure function of (config, seed, `i`);
- `pipeline.py`: `prepare`, which opens the cache and returns the `Data` the trainer reads.
"""

from transformer.data.batches import example_batch
from transformer.data.cache import cache_directory, make_tokenizer
from transformer.data.objectives import Vocab, document_layout, extra_ids, make_objective, row_lengths, row_tokens
from transformer.data.pipeline import Data, prepare
from transformer.data.sources import DataError, hub_offline, hub_unreachable
from transformer.data.splits import load_splits
from transformer.data.tokenizer import ByteTokenizer, TokenizerError, load_pretrained

__all__ = [
    "ByteTokenizer",
    "Data",
    "DataError",
    "TokenizerError",
    "Vocab",
    "cache_directory",
    "document_layout",
    "example_batch",
    "extra_ids",
    "hub_offline",
    "hub_unreachable",
    "load_pretrained",
    "load_splits",
    "make_objective",
    "make_tokenizer",
    "prepare",
    "row_lengths",
    "row_tokens",
]
