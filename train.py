"""python train.py [CONFIG.yaml] [key.path=value ...] [--workdir DIR] [--dry-run]"""

import sys

from transformer.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
