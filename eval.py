"""python eval.py --workdir DIR [--step N] [--split val] [--batches M] [--json] [key.path=value ...]
python eval.py --workdir DIR --generate "prompt" [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]"""

import sys

from transformer.accelerator import restart_with_malloc_tunables  # the standard library's only

if __name__ == "__main__":
    restart_with_malloc_tunables()  # before JAX and the CLI's imports: glibc reads its tunables once
    from transformer.cli import eval_main

    sys.exit(eval_main())
