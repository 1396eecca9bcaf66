import sys

from ..studies import report_main as main

sys.exit(main())
