"""`python -m driver` is `tandem-driver`."""

import sys

from driver.cli import driver_main

sys.exit(driver_main())
