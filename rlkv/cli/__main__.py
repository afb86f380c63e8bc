"""`python -m rlkv.cli ...`: the `rlkv` command without its console script (a checkout on PYTHONPATH,
e.g. a machine that cannot install rlkv)."""

import sys

from rlkv.cli import main

if __name__ == "__main__":  # importing the module (tests/test_architecture.py does) runs nothing
    sys.exit(main())
