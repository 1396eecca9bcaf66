import sys

from ..studies.registry import report_main as main

sys.exit(main())
