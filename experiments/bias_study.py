"""The bias study's repo-root entry point (not installed): ``python -m experiments.bias_study``
runs ``seco_lab.study.main``, the same as ``seco-lab bias-study``."""

import sys

from seco_lab.study import main

if __name__ == "__main__":
    sys.exit(main())
