"""python eval.py --workdir DIR [--step N] [--split val] [--batches M] [--json] [key.path=value ...]
python eval.py --workdir DIR --generate "prompt" [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]"""

import sys

from transformer.accelerator import restart_with_malloc_tunables
from transformer.cli import eval_main

if __name__ == "__main__":
    restart_with_malloc_tunables()  # before JAX starts: glibc reads its tunables once
    sys.exit(eval_main())
