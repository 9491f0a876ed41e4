"""python eval.py --workdir DIR [--step N] [--split val] [--batches M] [--json] [key.path=value ...]
python eval.py --workdir DIR --generate "prompt" [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]"""

import sys

from transformer.cli import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())
