"""A module whose import takes $WARM_SLOW_IMPORT seconds: a warm server that is still importing, for
tests/test_local_warm_start.py."""

import os
import time

time.sleep(float(os.environ.get("WARM_SLOW_IMPORT", "0")))
